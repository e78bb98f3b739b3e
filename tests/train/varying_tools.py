"""A tool the tool model calls by name: `multiply`, with the schema of
tests.rollout.tool_models.multiply, whose answer differs from call to call (a * b, then ten
and a hundred times that). Samples that call it differ in their tool messages, so the
comparisons iterative RL draws from a sharp tool model are not all ties. Importable by a
worker process, which keeps its own count."""

import itertools

from tests.rollout.tool_models import multiply as _exact

_calls = itertools.count()


def multiply(a: int, b: int) -> int:
    return a * b * 10 ** (next(_calls) % 3)


multiply.__doc__ = _exact.__doc__
