"""Turn a name -> tensor mapping into a ready `DecoderModel`, with clear errors when it does not fit."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from ssd.workers.models.config import ModelConfig
from ssd.workers.models.decoder import DecoderModel

_INIT_FNS = ("normal_", "uniform_", "kaiming_uniform_", "kaiming_normal_", "trunc_normal_", "zeros_", "ones_")


@contextmanager
def _empty_params() -> Iterator[None]:
    """Build modules with parameters on the meta device and no random init (like accelerate's
    `init_empty_weights` + transformers' `no_init_weights`): no memory, no init time, and buffers such as
    the rope table are still computed for real. Parameters are created (uninitialised) on CPU and moved
    to meta as they are registered; a `torch.device("meta")` context would also run `__init__`'s buffer
    maths on meta, which imports torch._dynamo (~6 s)."""
    register = nn.Module.register_parameter
    inits = {name: getattr(nn.init, name) for name in _INIT_FNS}

    def register_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None and not param.is_meta:
            module._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    try:
        nn.Module.register_parameter = register_on_meta  # type: ignore[method-assign]
        for name in _INIT_FNS:
            setattr(nn.init, name, lambda t, *args, **kwargs: t)
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]
        for name, fn in inits.items():
            setattr(nn.init, name, fn)


def _meta_model(cfg: ModelConfig) -> DecoderModel:
    with _empty_params():
        return DecoderModel(cfg)


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint must provide for `cfg`, with its shape (HF names, no `model.` prefix)."""
    shapes = {k: tuple(v.shape) for k, v in _meta_model(cfg).state_dict().items()}
    if cfg.tie_word_embeddings:
        shapes.pop("lm_head.weight")  # shares embed_tokens.weight
    return shapes


def check_tensor(
    name: str, shape: tuple[int, ...], expected: dict[str, tuple[int, ...]], source: str
) -> None:
    want = expected.get(name)
    if want is not None and tuple(shape) != want:
        raise ValueError(
            f"{source}: tensor {name!r} has shape {tuple(shape)}, expected {want} from the config"
        )


def build_model(
    cfg: ModelConfig, tensors: dict[str, torch.Tensor], source: str, device: str | torch.device
) -> DecoderModel:
    """Assign `tensors` (already in the target dtype and on `device`) into a fresh model."""
    expected = expected_shapes(cfg)
    missing = sorted(set(expected) - set(tensors))
    if missing:
        raise ValueError(
            f"{source}: {len(missing)} tensor(s) missing from the checkpoint, e.g. {', '.join(missing[:5])}"
        )
    unexpected = sorted(set(tensors) - set(expected))
    if unexpected:
        raise ValueError(
            f"{source}: {len(unexpected)} unexpected tensor(s) for a {cfg.arch} model, "
            f"e.g. {', '.join(unexpected[:5])}"
        )
    for name, t in tensors.items():
        check_tensor(name, tuple(t.shape), expected, source)

    model = _meta_model(cfg)
    # strict=False only because a tied lm_head is not in `tensors`; completeness was checked above.
    model.load_state_dict(tensors, strict=False, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    # Buffers (the fp32 rope table) are not in checkpoints; they were computed on CPU at construction.
    for mod in model.modules():
        for name, buf in mod._buffers.items():
            if buf is not None:
                mod._buffers[name] = buf.to(device)
    model.eval()
    model.requires_grad_(False)
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:  # defensive: a new parameter in DecoderModel the loaders do not know about
        raise ValueError(f"{source}: tensors left uninitialised: {', '.join(left[:5])}")
    return model
