"""`python -m grpo ...`: the `grpo` command, as torchrun launches it (`torchrun ... -m grpo train CONFIG`)."""

import sys

from grpo.launch import main

sys.exit(main())
