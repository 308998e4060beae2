"""Hidden states of chosen layers, taken from a runner's forward passes (DESIGN §9).

SPIRe's draft reads the target's activations entering given blocks (its feedback memory), and
its own layers' outputs; EAGLE-style drafters read the last layer's. A ``HiddenStateTap`` hooks
the decoder's blocks while the runner is attached and keeps, for the latest pass, the hidden
state entering each chosen block: index j < num_layers is the input of block j (index 0 the
embeddings), index num_layers the last block's output (the input of the final norm).

Invariant: after a pass, ``latest[j]`` is [N, hidden] for the pass's N packed tokens, in the
pass's order. Eager passes hand over the model's own tensors (no copy). A CUDA graph keeps the
tensors its capture saw alive, so a replay writes them in place and the runner hands over
views of them (graphs.py).

Cost: one Python hook call per chosen block and pass; no copy, no kernel.
"""

from __future__ import annotations

import torch


class UnsupportedLayersError(TypeError):
    """The model's decoder has no list of blocks (``.layers``) and final norm (``.norm``) to hook."""


def decoder_parts(model: torch.nn.Module) -> tuple[torch.nn.ModuleList, torch.nn.Module]:
    """(blocks, final norm) of a transformers causal LM's decoder, for Llama-like models
    (``model.model.layers`` and ``model.model.norm``)."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
    blocks, norm = getattr(decoder, "layers", None), getattr(decoder, "norm", None)
    if not isinstance(blocks, torch.nn.ModuleList) or norm is None:
        raise UnsupportedLayersError(f"{type(model).__name__}'s decoder has no `layers` list and `norm` module; "
                                     "hidden states are taken from Llama-like decoders (Llama, Qwen2, Mistral)")
    return blocks, norm


class HiddenStateTap:
    def __init__(self, model: torch.nn.Module, layers: tuple[int, ...]):
        blocks, norm = decoder_parts(model)
        bad = [j for j in layers if not 0 <= j <= len(blocks)]
        if bad:
            raise ValueError(f"hidden states {bad} do not exist: {type(model).__name__} has {len(blocks)} blocks, "
                             f"so indices run from 0 (the embeddings) to {len(blocks)} (the last block's output)")
        self.layers = tuple(sorted(set(layers)))
        self._modules = {j: (blocks[j] if j < len(blocks) else norm) for j in self.layers}
        self._handles: list = []
        self.latest: dict[int, torch.Tensor] = {}  # index -> [N, hidden] of the latest pass

    def __enter__(self) -> "HiddenStateTap":
        for index, module in self._modules.items():
            self._handles.append(module.register_forward_pre_hook(self._keeper(index), with_kwargs=True))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _keeper(self, index: int):
        def hook(module, args, kwargs):
            hidden = args[0] if args else kwargs["hidden_states"]  # [1, N, hidden]
            self.latest[index] = hidden[0]
        return hook
