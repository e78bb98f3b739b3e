"""A causal LM made ready to train: the policy loaded from `model`, or handed to `grpo.train`
already loaded (`GivenPolicy`); activation checkpointing (on and off), LoRA on a base loaded whole or in 4 bits
(QLoRA), autocast, the parameters an optimizer moves. Loading from a folder or hub id is
`grpo.infra.hf.load_causal_lm`; the forward passes over a Rollout are `grpo.train.layouts`;
the reference and the critic, `grpo.train.networks`.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import sys
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from grpo.errors import UserError, first_line
from grpo.infra.hf import load_causal_lm, load_error, load_tokenizer, model_config, torch_dtype, with_pad_token
from grpo.refusals import refuse

# What config.yaml's `model` says of a policy handed to grpo.train as an object (its
# name_or_path follows), so that a resume from the command line says to hand it again.
GIVEN_MODEL = "<model given to grpo.train"


@dataclass(frozen=True)
class GivenPolicy:
    """What `grpo.train` was handed already loaded (model=, tokenizer=; TRL's model and
    processing_class), used instead of loading config.model: a transformers PreTrainedModel
    (trained in place, in its own dtype) and its tokenizer, or a tokenizer alone (the model
    then loads from config.model)."""

    model: nn.Module | None
    tokenizer: Any


def given_policy(model: Any, tokenizer: Any) -> GivenPolicy | None:
    """`grpo.train`'s model= (an object; a name goes into the config instead) and tokenizer=,
    checked before any other model loads; None when neither was given. A model without its
    tokenizer takes the one its name_or_path loads, as TRL's GRPOTrainer does."""
    if model is None and tokenizer is None:
        return None
    if model is not None:
        from transformers import PreTrainedModel

        if not isinstance(model, PreTrainedModel):
            raise UserError(
                "model: expected a model folder or hub id, or a transformers PreTrainedModel "
                f"(AutoModelForCausalLM.from_pretrained), got {type(model).__name__}"
            )
    if tokenizer is None:
        name = model.name_or_path
        try:
            tokenizer = load_tokenizer(name, "tokenizer")
        except UserError:
            raise UserError(
                "tokenizer: hand the model's tokenizer too (tokenizer=, TRL's processing_class=): "
                f"none loads from its name_or_path {name!r}"
            ) from None
    if not callable(getattr(tokenizer, "apply_chat_template", None)):
        raise UserError(f"tokenizer: expected a transformers tokenizer, got {type(tokenizer).__name__}")
    return GivenPolicy(model, with_pad_token(tokenizer, "the tokenizer handed to grpo.train", "tokenizer"))


def given_model_name(model) -> str:
    """config.yaml's `model` for a policy handed over as an object."""
    return f"{GIVEN_MODEL}: {model.name_or_path or type(model).__name__}>"


def check_given(c, given: GivenPolicy | None) -> None:
    """What a policy handed over as an object cannot do, before any model loads: reach a
    generator's process (rollout.async loads the policy there from `model`), or be the
    critic's start (value.model: the policy's folder by default), or be loaded in 4 bits
    (lora.quantize: a model handed over is used as it was loaded). And a resume from a
    config.yaml whose model was handed over, without it."""
    if given is None:
        if c.model.startswith(GIVEN_MODEL):
            raise UserError(
                "model: this run's model was handed to grpo.train(model=...): hand it again, or name its folder in model"
            )
        return
    if c.rollout.async_.max_staleness > 0:
        refuse("given-policy+async")
    if given.model is not None and c.loss.baseline == "critic" and not c.value.model:
        refuse("given-model+critic")
    if given.model is not None and c.lora.quantize != "none":
        refuse("given-model+quantize", quantize=c.lora.quantize)


def policy_config(path: str, given: GivenPolicy | None):
    """The policy's `PretrainedConfig`: the given model's, else read from `path` (no weights)."""
    if given is not None and given.model is not None:
        return given.model.config
    return model_config(path)


def policy_tokenizer(path: str, given: GivenPolicy | None):
    """The policy's tokenizer: the one handed over, else loaded from `path`."""
    return given.tokenizer if given is not None else load_tokenizer(path)


def policy_model(
    path: str, given: GivenPolicy | None, dtype: str, attention: str | None, device, quantize: str = "none"
):
    """The policy, before it is made ready to train: the model handed over (on `device`, in
    eval mode and with train.attention's implementation, as `load_causal_lm` loads one),
    else loaded from `path` in `dtype`, its linear layers in 4 bits with lora.quantize
    (`load_4bit`)."""
    if given is None or given.model is None:
        if quantize != "none":
            return load_4bit(path, dtype, quantize, attention, device)
        return load_causal_lm(path, dtype, attention=attention, device=device)
    model = given.model
    if is_quantized(model):  # loaded in 4 bits by the caller: it stays where it was loaded
        prepare_4bit(model)
        return model.eval()
    if attention is not None and model.config._attn_implementation != attention:
        try:
            model.set_attn_implementation(attention)
        except Exception as err:  # transformers' refusal of an implementation this model lacks
            raise UserError(
                f"train.attention: the model handed to grpo.train cannot use {attention!r} ({first_line(err)})"
            ) from None
    return model.to(device).eval()


# ---- QLoRA: the base in 4 bits (lora.quantize) -------------------------------------------------


def quantize_missing(quantize: str) -> str | None:
    """Why lora.quantize cannot load a 4-bit base here (one line, with the install), or None;
    asked before any model loads. transformers loads a 4-bit model through bitsandbytes and
    accelerate."""
    if quantize == "none":
        return None
    absent = [name for name in ("bitsandbytes", "accelerate") if importlib.util.find_spec(name) is None]
    if not absent:
        return None
    return f"lora.quantize: {quantize} needs {' and '.join(absent)}, not installed here: pip install 'grpo[memory]'"


def compute_dtype_4bit(device) -> torch.dtype:
    """What a 4-bit layer computes in (bitsandbytes dequantizes each weight to it for its
    matmul): bfloat16 on a GPU that has it, as QLoRA does; float32 elsewhere, where a bf16
    matmul is slow (a CPU without AVX-512 BF16 or AMX) or missing, and where the log-probs are
    then those of the dequantized weights to float32 rounding."""
    if torch.device(device).type == "cuda" and torch.cuda.is_bf16_supported():
        return torch.bfloat16
    return torch.float32


def load_4bit(path: str, dtype: str, quant_type: str, attention: str | None, device):
    """The causal LM at `path` with its linear layers (not the head) in 4 bits, `quant_type`
    nf4 or fp4 with double quantization (QLoRA's recipe: bitsandbytes' Linear4bit), on
    `device`, in eval mode; every other weight (embeddings, norms, the head) in `dtype`.

    peft's prepare_model_for_kbit_training is not called: what it does is done here otherwise
    (the base frozen by the adapter, checkpointing without the reentrant variant that needs
    inputs with gradients) but for casting every unquantized weight to float32, which would
    undo train.dtype: bfloat16's savings on the embedding and the head."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    config = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=quant_type,
        bnb_4bit_compute_dtype=compute_dtype_4bit(device),
        bnb_4bit_use_double_quant=True,
    )
    options = dict(
        dtype=torch_dtype(dtype, "train.dtype"),
        attn_implementation=attention,
        quantization_config=config,
        device_map={"": str(device)},
    )
    try:
        with contextlib.ExitStack() as files:
            model = _load_read(path, files, options) or AutoModelForCausalLM.from_pretrained(path, **options)
    except Exception as err:  # transformers', accelerate's or bitsandbytes' refusal, of many kinds
        raise UserError(f"lora.quantize: cannot load '{path}' in 4 bits ({load_error(err)})") from None
    prepare_4bit(model)
    return model.eval()


def _load_read(path: str, files: contextlib.ExitStack, options: dict):
    """The model in the local folder `path` loaded as `load_4bit` asks (`options`), each tensor
    of its safetensors files read into memory of its own as the load reaches it (safetensors'
    pread backend, which transformers itself uses where a file cannot be mapped), or None where
    `path` holds no such files or no transformers architecture: the caller loads it as usual.

    A usual load maps each file and reads the tensors from the mapping; the tensors kept as
    loaded (the embeddings, the norms, the head) keep the whole mapping, so every page the
    quantization read, all the full-precision linear weights, would stay resident beside
    their 4-bit copies for the whole run."""
    import json
    from pathlib import Path

    from safetensors import safe_open
    from transformers import AutoConfig, GenerationConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    folder = Path(path).expanduser()
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (folder / "model.safetensors").is_file():
        names = ["model.safetensors"]
    else:
        return None
    config = AutoConfig.from_pretrained(str(folder))
    architecture = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(config), None)
    if architecture is None:  # a model of its own code (trust_remote_code): loaded as usual
        return None
    weights = {}
    for name in names:
        handle = files.enter_context(safe_open(str(folder / name), framework="pt", device="cpu", backend="pread"))
        weights.update({key: handle.get_slice(key) for key in handle.keys()})  # read when the load reaches them
    generation = (
        GenerationConfig.from_pretrained(str(folder)) if (folder / "generation_config.json").is_file() else None
    )
    model = architecture.from_pretrained(
        None, config=config, state_dict=weights, generation_config=generation, **options
    )
    model.name_or_path = model.config._name_or_path = path  # as a load from the folder names it
    return model


def prepare_4bit(model) -> None:
    """bitsandbytes' 4-bit layers made to hold still. Their weights stay as they were
    quantized: on a CPU with AVX-512 BF16, bitsandbytes repacks a layer for inference at its
    first pass without a gradient (a reference or sampling pass) and rounds its block scales
    to bf16, so that every later pass, the policy's included, would compute with other weights
    than the first. And a checkpoint's state loads back: its 4-bit weights are the base's as
    loaded (they never train), so their packed bytes are copied and the quantization state
    the load made is kept, where torch would refuse the state's entries as unexpected keys."""
    for module in model.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False
            module.register_load_state_dict_pre_hook(_kept_quantization_state)


def _kept_quantization_state(module, state_dict, prefix, *args) -> None:
    for key in [k for k in state_dict if k.startswith(prefix + "weight.")]:  # weight.absmax, weight.quant_map, ...
        del state_dict[key]


def is_quantized(model) -> bool:
    """Whether `model` (peft-wrapped or not) holds 4-bit layers (lora.quantize)."""
    get = getattr(model, "get_base_model", None)
    return bool(getattr(get() if callable(get) else model, "is_loaded_in_4bit", False))


# safetensors' names of the dtypes a model's weights come in
_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64"}


def save_dequantized(policy, directory) -> None:
    """A 4-bit policy (QLoRA) written into `directory` as a plain transformers model of what it
    computes: each 4-bit weight dequantized and its adapter's delta added (`policy_weights`),
    every weight in the dtype of the unquantized ones (train.dtype); no adapter, no
    quantization config. What final/ and best/ hold for a QLoRA run: merging the adapter into
    the 4-bit weights instead would round it away (TRL #3466).

    Written one tensor at a time into model.safetensors (`write_safetensors`): a whole
    dequantized copy of the model never sits beside the 4-bit one."""
    from pathlib import Path

    from grpo.rollout.weights import base_model, policy_weights

    model = base_model(policy)
    dtype = model.get_input_embeddings().weight.dtype
    tied = getattr(model.config, "tie_word_embeddings", False)
    config = copy.deepcopy(model.config)
    for key in ("quantization_config", "_pre_quantization_dtype"):
        if hasattr(config, key):
            delattr(config, key)
    config.architectures, config.dtype = [type(model).__name__], dtype
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(directory)
    if model.can_generate() and model.generation_config is not None:
        model.generation_config.save_pretrained(directory)
    weights = (
        (name, t.to("cpu", dtype))
        for name, t in policy_weights(policy)
        if not (tied and name == "lm_head.weight")  # the head is the embedding
    )
    names = [name for name, _ in model.named_parameters()] + ["lm_head.weight"]
    write_safetensors(directory / "model.safetensors", weights, names)


def write_safetensors(path, weights, names: list[str]) -> None:
    """`weights` ((name, tensor) pairs, read lazily) into one safetensors file at `path`, each
    tensor written and dropped before the next is read. Its header, written last, needs room
    before the data: `names` bounds it (no tensor is named longer than these are, nor are there
    more of them); the room it does not fill is spaces, which the format allows."""
    import json
    import struct

    room = sum(len(name) + 100 for name in names) + 100  # a tensor's entry: its name, dtype, shape, offsets
    room = -(-room // 8) * 8  # the data start 8-byte aligned, as safetensors writes it
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    with open(path, "wb") as f:
        f.seek(8 + room)
        for name, tensor in weights:
            data = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
            f.write(memoryview(data.numpy()))
            size = data.numel()
            header[name] = {
                "dtype": _SAFETENSORS_DTYPES[tensor.dtype],
                "shape": list(tensor.shape),
                "data_offsets": [offset, offset + size],
            }
            offset += size
            del tensor, data
        text = json.dumps(header, separators=(",", ":")).encode()
        if len(text) > room:
            raise ValueError(f"{path}: the header of {len(header) - 1} tensors needs {len(text)} bytes, {room} kept")
        f.seek(0)
        f.write(struct.pack("<Q", room) + text + b" " * (room - len(text)))


def autocast(model, dtype: torch.dtype | None):
    """`torch.autocast` in `dtype` on the model's device; does nothing when dtype is None.
    Matmuls run in `dtype`; weights, gradients and optimizer state stay in theirs."""
    device = next(model.parameters()).device.type
    return torch.autocast(device, dtype=dtype or torch.bfloat16, enabled=dtype is not None)


def enable_checkpointing(model) -> bool:
    """Prepare `model` for activation checkpointing (train.gradient_checkpointing): each decoder
    layer keeps only its input and recomputes the rest in the backward pass. transformers
    checkpoints only in training mode, so dropout is switched off for good here (RL runs
    without it) and `activation_checkpointing` puts the model in training mode for the
    policy's forward only. A model that cannot checkpoint (no transformers support) trains
    without, with a warning, since checkpointing is on by default: returns whether it is on."""
    if not getattr(model, "supports_gradient_checkpointing", False):
        print(
            f"grpo: warning: train.gradient_checkpointing: {type(model).__name__} does not support it; "
            "training without (more activation memory)",
            file=sys.stderr,
        )
        return False
    _no_dropout(model)
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x; the older name is deprecated there
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    return True


def _no_dropout(model) -> None:
    """Every dropout of `model` at probability 0, so that training mode computes what eval mode
    does: the nn.Dropout modules, and the probabilities that layers keep as floats and pass to
    `F.dropout(..., training=self.training)` themselves (OPT's `dropout`, `activation_dropout`
    and `layerdrop`, attention_dropout in most). Otherwise the policy's checkpointed forward
    would drop activations, and the backward's recomputation, which runs after the model is back
    in eval mode, would save other tensors than the forward did (torch's CheckpointError)."""
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
        for name, value in vars(module).items():
            if "drop" in name and isinstance(value, float):
                setattr(module, name, 0.0)


@contextlib.contextmanager
def activation_checkpointing(model, enabled: bool):
    """Training mode (where transformers checkpoints) for the duration, then eval mode again."""
    if not enabled:
        yield
        return
    model.train()
    try:
        yield
    finally:
        model.eval()


def apply_lora(model, r: int, alpha: float, target_modules, adapter: str = ""):
    """`model` wrapped by peft, in eval mode: a new LoRA adapter of rank `r` (B = 0: the model
    as it was), or with `adapter` the one saved in that peft folder (lora.init_adapter), trainable
    (`load_adapter`). Dropout off either way: RL runs without it."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError:
        raise UserError("lora.r > 0 needs peft: pip install 'grpo[lora]'") from None
    if adapter:
        return load_adapter(model, adapter, r)
    config = LoraConfig(r=r, lora_alpha=alpha, lora_dropout=0.0, target_modules=target_modules, bias="none")
    return get_peft_model(model, config).eval()


def disable_checkpointing(model) -> None:
    if hasattr(model, "activation_checkpointing_disable"):  # transformers >= 5.x
        model.activation_checkpointing_disable()
    else:
        model.gradient_checkpointing_disable()


def trainable_parameters(model: nn.Module) -> list:
    """The parameters the optimizer moves (with LoRA, the adapter's only)."""
    return [p for p in model.parameters() if p.requires_grad]


def count_parameters(model: nn.Module | None) -> int:
    return 0 if model is None else sum(p.numel() for p in model.parameters())


class TiedGradient:
    """Where the LM head's gradient of a tied weight waits for the input embedding's.

    Autograd sums the two uses' gradients of a tied (V, H) weight before storing it, and
    torch's embedding backward makes its share dense: a second (V, H) tensor, zero but for
    the rows looked up, held beside the head's while they are added, at the backward's peak.
    Here the chunked head (`grpo.algo.logprobs`, which
    finds this object on the weight as `_grpo_tied_gradient`) hands its gradient over instead
    of returning it (`give`), and the embedding's backward adds its rows into that tensor in
    place and returns it as the weight's one gradient (`take`): the same numbers, added in the
    same order, and one (V, H) tensor fewer. If no embedding backward takes it (a graph with
    the head and not the embedding), it is added to the weight's `.grad` when the backward ends."""

    def __init__(self, weight: torch.Tensor):
        self.weight = weight
        self.waiting: torch.Tensor | None = None

    def reset(self) -> None:
        """A new forward: nothing of an earlier backward waits (one that raised, say)."""
        self.waiting = None

    def give(self, grad: torch.Tensor) -> None:
        """The head's gradient, held until the embedding's backward (summed with another head's)."""
        if self.waiting is None:
            self.waiting = grad
            torch.autograd.Variable._execution_engine.queue_callback(self._orphan)
        else:
            self.waiting.add_(grad)  # as autograd adds two uses' gradients

    def take(self) -> torch.Tensor | None:
        grad, self.waiting = self.waiting, None
        return grad

    def _orphan(self) -> None:
        grad = self.take()
        if grad is None:
            return
        weight = self.weight
        weight.grad = grad if weight.grad is None else weight.grad.add_(grad)


class _RowsGradient(torch.autograd.Function):
    """F.embedding(ids, weight, padding_idx) whose backward adds the rows looked up into the
    head's waiting gradient (`TiedGradient`) and returns that; with none waiting, the dense
    gradient torch's own backward makes (summed in the same order)."""

    @staticmethod
    def forward(ctx, ids: torch.Tensor, weight: torch.Tensor, padding_idx: int | None, tied: TiedGradient):
        ctx.save_for_backward(ids)
        ctx.shape, ctx.padding_idx, ctx.tied = weight.shape, padding_idx, tied
        return nn.functional.embedding(ids, weight, padding_idx)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out: torch.Tensor):
        (ids,) = ctx.saved_tensors
        flat, grad = ids.reshape(-1), grad_out.reshape(-1, grad_out.shape[-1])
        if ctx.padding_idx is not None:  # the padding row gets no gradient, as in nn.Embedding
            keep = flat != ctx.padding_idx
            flat, grad = flat[keep], grad[keep]
        waiting = ctx.tied.take()
        if waiting is None:  # torch's dense gradient: zeros, each position's row added in turn
            return None, grad.new_zeros(ctx.shape).index_add_(0, flat, grad), None, None
        # Each row's positions summed in turn, then added to the head's: as autograd adds the dense one.
        rows, inverse = torch.unique(flat, sorted=True, return_inverse=True)
        sums = grad.new_zeros(len(rows), grad.shape[1]).index_add_(0, inverse, grad)
        return None, waiting.index_add_(0, rows, sums), None, None


class _TiedEmbedding(nn.Embedding):
    """nn.Embedding whose weight's gradient joins the chunked head's in place (`TiedGradient`)."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        tied = getattr(self.weight, "_grpo_tied_gradient", None)  # not on FSDP2's gathered weight
        if tied is None or not (torch.is_grad_enabled() and self.weight.requires_grad):
            return super().forward(input)
        return _RowsGradient.apply(input, self.weight, self.padding_idx, tied)


def tie_gradients_in_place(model) -> bool:
    """With the input embedding tied to the LM head (Qwen2, SmolLM2, GPT-2, ...), let the
    chunked head's gradient and the embedding's meet in one tensor (`TiedGradient`): the same
    numbers, one (V, H) gradient fewer at the backward's end. Done where the embedding is a
    plain nn.Embedding (not Gemma's scaled one; no max_norm, scale_grad_by_freq or sparse
    gradient) whose weight is trained and is the head's. Under FSDP2 the head computes with
    the gathered weight, which carries no `TiedGradient`: the gradients are added as torch
    adds them. Returns whether it was done."""
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    if (
        type(embedding) is not nn.Embedding
        or head is None
        or getattr(head, "weight", None) is not embedding.weight
        or not embedding.weight.requires_grad
        or embedding.max_norm is not None
        or embedding.scale_grad_by_freq
        or embedding.sparse
    ):
        return False
    embedding.weight._grpo_tied_gradient = TiedGradient(embedding.weight)
    embedding.__class__ = _TiedEmbedding
    return True


# ---- LoRA adapters as files (lora.save, lora.init_adapter) -------------------------------------

ADAPTER_CONFIG = "adapter_config.json"  # what makes a folder a peft adapter
ADAPTER_FOLDER = "adapter"  # lora.save: both: the adapter's folder inside final/ and best/


def adapter_folder(directory, save: str):
    """Where lora.save (or `grpo sft --lora-save`) puts a LoRA policy's adapter in a model
    folder: the folder itself (adapter), its adapter/ beside the merged model (both), or
    nowhere (merged)."""
    from pathlib import Path

    return {"adapter": Path(directory), "both": Path(directory) / ADAPTER_FOLDER}.get(save)


def save_adapter(policy, directory, *, main: bool = True) -> None:
    """A LoRA policy's adapter as peft writes it into `directory` (adapter_config.json and
    adapter_model.safetensors): what PeftModel.from_pretrained(base, directory) loads, vLLM
    serves as a LoRA request and lora.init_adapter starts from, its base_model_name_or_path the
    base the policy was wrapped around. The trained tensors whole: an FSDP2 shard is gathered
    one tensor at a time, in the same order in every process, so every process calls it and
    process 0 (`main`) writes."""
    from grpo.rollout.weights import _full

    weights = {}
    with torch.no_grad():
        for name, param in policy.named_parameters():
            if param.requires_grad:  # the adapter's: the base is frozen
                tensor = _full(param).to("cpu", copy=True)
                if main:
                    weights[name] = tensor
    if main:  # embeddings are never resized here: nothing of the base goes in (and no hub lookup)
        policy.save_pretrained(str(directory), state_dict=weights, save_embedding_layers=False)


def load_adapter(model, folder: str, r: int):
    """`model` wrapped by peft with the LoRA adapter saved in `folder` (lora.init_adapter:
    `grpo sft --lora-save adapter`'s output, a run's final/ with lora.save: adapter, or another
    tool's), trainable and in eval mode, as a new adapter is: its rank, alpha and target
    modules its own (lora.r, `r`, must be its rank; lora.alpha and lora.target_modules are not
    read), its dropout off, and the base it names from now on `model`'s."""
    import json
    from pathlib import Path

    from peft import LoraConfig, PeftModel

    key, path = "lora.init_adapter", Path(folder).expanduser()
    if not (path / ADAPTER_CONFIG).is_file():
        if path.is_dir():
            raise UserError(f"{key}: '{folder}' holds no peft adapter (no {ADAPTER_CONFIG})")
        raise UserError(f"{key}: no such directory '{folder}'")
    try:
        settings = json.loads((path / ADAPTER_CONFIG).read_text())
    except (OSError, ValueError) as err:
        raise UserError(f"{key}: cannot read {path / ADAPTER_CONFIG} ({first_line(err)})") from None
    kind = settings.get("peft_type")
    if kind != "LORA":
        raise UserError(f"{key}: '{folder}' holds a {kind} adapter; only a LoRA adapter trains here")
    if settings.get("r") != r:
        raise UserError(
            f"lora.r: {r}, but lora.init_adapter '{folder}' is an adapter of rank {settings.get('r')}: "
            f"set lora.r to {settings.get('r')} (its alpha and target modules are its own)"
        )
    config = LoraConfig.from_pretrained(str(path))
    config.lora_dropout = 0.0
    config.task_type = None  # wrapped as a new adapter is (a plain PeftModel), whatever trained it
    config.base_model_name_or_path = getattr(model, "name_or_path", None) or None
    try:
        policy = PeftModel.from_pretrained(model, str(path), config=config, is_trainable=True, torch_device="cpu")
    except Exception as err:  # shapes or names that are not this model's
        raise UserError(f"{key}: cannot load the adapter in '{folder}' onto this model ({first_line(err)})") from None
    return policy.eval()
