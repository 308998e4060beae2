"""The SPIRe draft model (Neelam et al., MatX 2025, arXiv 2504.06419; ALGORITHMS.md sections 5, 8).

A draft built from a Llama-like target for large batches and long contexts:
- **pruned initialisation**: the target's embedding, its last quarter of blocks (``source_layers``)
  and its final norm and head, at the target's width;
- **static sparse attention**: ``sink`` first positions plus a ``window`` of recent ones, at the
  text's own positions, so its KV read per token is constant in the context length;
- **feedback memory**: draft block i takes its keys and values from memory vectors. For verified
  positions the memory is the target's hidden state entering target block ``source_layers[i]``
  (so at initialisation the draft block computes that target block's own keys and values); for
  positions the draft has fed itself, a learned softmax-weighted mix of its embedding and its
  blocks' outputs there (``memory_mix``, one row of weights per block). The token being fed
  attends to itself with the keys and values of its own block input, as in any decoder.

``unrolled_logits`` is the training forward (blockwise unrolled, "batched autoregressive
decoding with teacher forcing"): target memory before each block start, the draft's own memory
inside the block. ``drafters.spire.SPIReDrafter`` runs the same computation through the runner.

Cost: a draft step is len(source_layers) blocks over sink + window + the block's own keys a
row; its cache holds keys for those blocks only.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from ..runner import UnsupportedModelError

CONFIG_NAME = "spire.json"
SPIRE_ROLE = "spire"  # the runner roles (spire-0, ...) whose passes get the memory writes
WEIGHTS_NAME = "spire.safetensors"


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def check_llama_like(model) -> None:
    """SPIRe's wiring reads blocks of the Llama layout: pre-norm attention with q/k/v/o projections
    and full rotary embeddings, then a pre-norm MLP."""
    decoder = getattr(model, "model", None)
    blocks = getattr(decoder, "layers", None)
    needed = ("input_layernorm", "post_attention_layernorm", "self_attn", "mlp")
    if blocks is None or not all(hasattr(blocks[0], name) for name in needed) or not hasattr(decoder, "rotary_emb"):
        raise UnsupportedModelError(f"{type(model).__name__} is not Llama-like (model.layers[i] with input_layernorm, "
                                    "self_attn, post_attention_layernorm, mlp; model.rotary_emb): SPIRe drafts "
                                    "for Llama, Qwen2 and Mistral targets")
    if hasattr(blocks[0].self_attn, "q_norm"):
        raise UnsupportedModelError(f"{type(model).__name__} normalises queries and keys per head, which SPIRe's "
                                    "memory projection does not implement")
    text_config = model.config.get_text_config()
    if getattr(text_config, "use_sliding_window", False) or "sliding_attention" in (getattr(text_config, "layer_types",
                                                                                            None) or []):
        raise UnsupportedModelError(f"{type(model).__name__} has sliding-window layers; SPIRe's draft has a "
                                    "window of its own")


class SpireDraft(torch.nn.Module):
    def __init__(self, model, source_layers: tuple[int, ...], sink: int = 1, window: int = 64, feedback: bool = True):
        """model: the draft causal LM (len(source_layers) blocks at the target's width);
        source_layers: the target block each draft block comes from; feedback: memory from the
        draft's own mix at fed positions (False: the ablation, its blocks' own keys and values)."""
        super().__init__()
        check_llama_like(model)
        blocks = model.model.layers
        if len(source_layers) != len(blocks):
            raise ValueError(f"{len(blocks)} draft blocks need as many source layers, got {list(source_layers)}")
        if sink < 0 or window < 1:
            raise ValueError(f"sink must be >= 0 and window >= 1, got sink={sink}, window={window}")
        self.model = model
        self.source_layers = tuple(int(j) for j in source_layers)
        self.sink, self.window, self.feedback = int(sink), int(window), bool(feedback)
        num_blocks = len(blocks)
        # block i's memory starts as its own input (state i of [embedding, block outputs]), then learns
        mix = torch.zeros(num_blocks, num_blocks + 1, dtype=torch.float32, device=model.device)
        mix[torch.arange(num_blocks), torch.arange(num_blocks)] = 4.0
        self.memory_mix = torch.nn.Parameter(mix)  # [blocks, blocks + 1] logits

    @classmethod
    def from_target(cls, target, num_blocks: int | None = None, sink: int = 1, window: int = 64,
                    feedback: bool = True, random_init: bool = False, seed: int = 0) -> "SpireDraft":
        """The draft of ``target``: its embedding, last ``num_blocks`` blocks (default: a quarter,
        at least one), final norm and head. random_init: the blocks start random (the ablation);
        the embedding, norm and head are still the target's."""
        check_llama_like(target)
        total = len(target.model.layers)
        num_blocks = max(1, total // 4) if num_blocks is None else num_blocks
        if not 1 <= num_blocks <= total:
            raise ValueError(f"num_blocks must be between 1 and the target's {total} blocks, got {num_blocks}")
        sources = tuple(range(total - num_blocks, total))
        config = copy.deepcopy(target.config)
        config.num_hidden_layers = num_blocks
        if getattr(config, "layer_types", None) is not None:
            config.layer_types = [config.layer_types[j] for j in sources]
        with torch.random.fork_rng(devices=[]):  # random blocks (the ablation) without touching the caller's RNG
            torch.manual_seed(seed)
            model = type(target)(config).to(device=target.device, dtype=target.dtype)
        with torch.no_grad():
            model.model.embed_tokens.load_state_dict(target.model.embed_tokens.state_dict())
            model.model.norm.load_state_dict(target.model.norm.state_dict())
            model.lm_head.load_state_dict(target.lm_head.state_dict())
            if not random_init:
                for block, source in zip(model.model.layers, sources):
                    block.load_state_dict(target.model.layers[source].state_dict())
        model.generation_config = copy.deepcopy(target.generation_config)
        return cls(model.eval(), sources, sink=sink, window=window, feedback=feedback)

    # -- saving ------------------------------------------------------------------------------
    def save(self, folder: str | Path) -> None:
        """The draft LM with save_pretrained (safetensors), its memory weights and a config."""
        folder = Path(folder)
        self.model.save_pretrained(folder)
        save_file({"memory_mix": self.memory_mix.detach().float().cpu().contiguous()}, str(folder / WEIGHTS_NAME))
        settings = dict(source_layers=list(self.source_layers), sink=self.sink, window=self.window,
                        feedback=self.feedback)
        (folder / CONFIG_NAME).write_text(json.dumps(settings, indent=2))

    @classmethod
    def load(cls, folder: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> "SpireDraft":
        folder = Path(folder)
        if not (folder / CONFIG_NAME).is_file():
            raise FileNotFoundError(f"{folder} holds no SPIRe draft ({CONFIG_NAME} missing); save one with "
                                    "SpireDraft.save or build the zoo")
        settings = json.loads((folder / CONFIG_NAME).read_text())
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device).eval()
        draft = cls(model, tuple(settings["source_layers"]), sink=settings["sink"], window=settings["window"],
                    feedback=settings["feedback"])
        with torch.no_grad():
            draft.memory_mix.copy_(load_file(str(folder / WEIGHTS_NAME))["memory_mix"])
        return draft

    # -- the pieces inference and training share ---------------------------------------------
    @property
    def num_blocks(self) -> int:
        return len(self.source_layers)

    def memory(self, states: torch.Tensor) -> torch.Tensor:
        """states [..., blocks + 1, hidden] (embedding, then each block's output) -> each block's
        memory vector [..., blocks, hidden]."""
        weights = self.memory_mix.softmax(dim=-1).to(states.dtype)  # [blocks, blocks + 1]
        return torch.einsum("is,...sd->...id", weights, states)

    def keys_values(self, block: int, hidden: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Draft block ``block``'s keys (rotated at ``positions``) and values of memory vectors:
        hidden [..., hidden], positions [...] -> keys, values [..., kv_heads, head_dim]."""
        layer = self.model.model.layers[block]
        attention = layer.self_attn
        normed = layer.input_layernorm(hidden)
        head_dim = attention.head_dim
        keys = attention.k_proj(normed).unflatten(-1, (-1, head_dim))
        values = attention.v_proj(normed).unflatten(-1, (-1, head_dim))
        cos, sin = self.rotary(normed, positions)
        return keys * cos + rotate_half(keys) * sin, values

    def rotary(self, like: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [..., 1, head_dim] at positions [...], broadcastable over heads."""
        flat = positions.reshape(1, -1)
        cos, sin = self.model.model.rotary_emb(like.reshape(1, -1, like.shape[-1])[:, :1], flat)
        shape = (*positions.shape, 1, cos.shape[-1])
        return cos.reshape(shape).to(like.dtype), sin.reshape(shape).to(like.dtype)

    def install_memory_writer(self) -> None:
        """Hook the draft LM so that every pass it runs through a SPIRe runner (role spire-N, the
        SPIReDrafter's) ends by writing each fed token's memory keys and values over the ones its
        blocks wrote (the block inputs and the last block's output, mixed by ``memory_mix``). The
        writes are GPU work inside the pass, so CUDA graphs capture them with it. Other passes
        (another drafter's runner on the same model, training, Hugging Face's own forward) and
        drafts without feedback are left alone. Idempotent."""
        if getattr(self, "_memory_hooks", None):
            return
        from ..attention_metadata import METADATA_KWARG

        kept: dict = {}  # the current pass's metadata and block inputs

        def keep_input(index: int):
            def hook(module, args, kwargs):
                if index == 0:
                    kept.clear()
                    kept["meta"] = kwargs.get(METADATA_KWARG)
                kept[index] = (args[0] if args else kwargs["hidden_states"])[0]  # [N, hidden]
            return hook

        def write_memory(module, args, kwargs):
            meta = kept.pop("meta", None)  # once: a later norm call outside a pass (training) finds none
            if meta is None or not meta.role.startswith(SPIRE_ROLE) or not self.feedback:
                return
            last = (args[0] if args else kwargs["hidden_states"])[0]  # [N, hidden], the last block's output
            states = torch.stack([kept[i] for i in range(self.num_blocks)] + [last], dim=1)  # [N, blocks + 1, hidden]
            memory = self.memory(states)  # [N, blocks, hidden]
            for block in range(self.num_blocks):
                keys, values = self.keys_values(block, memory[:, block], meta.token_positions)
                meta.cache.write(block, meta.token_rows, meta.token_positions, keys.transpose(0, 1),
                                 values.transpose(0, 1))

        decoder = self.model.model
        handles = [block.register_forward_pre_hook(keep_input(i), with_kwargs=True)
                   for i, block in enumerate(decoder.layers)]
        handles.append(decoder.norm.register_forward_pre_hook(write_memory, with_kwargs=True))
        self._memory_hooks = handles

    # -- training ----------------------------------------------------------------------------
    def unrolled_logits(self, input_ids: torch.Tensor, target_hidden: dict[int, torch.Tensor], starts: torch.Tensor,
                        steps: int) -> torch.Tensor:
        """The draft's logits over blocks of ``steps`` tokens from each start b, fed the text's own
        tokens (teacher forcing): at step i of block b it feeds token b + i and predicts b + i + 1,
        seeing the sink and window before b through the target's memory (``target_hidden``, the
        hidden states entering the source blocks, [B, T, hidden] by target block index), the
        block's earlier tokens through its own memory, and itself.

        input_ids [B, T]; starts [S] (each b + steps <= T) -> logits [B, S, steps, V]."""
        decoder = self.model.model
        batch, device = input_ids.shape[0], input_ids.device
        sink, window = self.sink, self.window
        sink_slots = torch.arange(sink, device=device).expand(len(starts), sink)  # [S, sink]
        window_slots = starts[:, None] - window + torch.arange(window, device=device)  # [S, W]
        context = torch.cat([sink_slots, window_slots], dim=1).clamp(0, input_ids.shape[1] - 1)  # [S, C]
        # a sink slot before the block, a window slot past the sink (not twice) and in the text
        context_seen = torch.cat([sink_slots < starts[:, None], (window_slots >= sink) & (window_slots >= 0)], dim=1)
        memory_keys, memory_values = [], []  # per block: [B, S, C + i, Hkv, D]
        every_position = torch.arange(input_ids.shape[1], device=device).expand(batch, -1)  # [B, T]
        for block, source in enumerate(self.source_layers):
            # each position's keys once (a position lies in about window / steps blocks' contexts), then gathered
            keys, values = self.keys_values(block, target_hidden[source], every_position)  # [B, T, Hkv, D]
            memory_keys.append(keys[:, context])  # [B, S, C, Hkv, D]
            memory_values.append(values[:, context])
        logits = []
        for step in range(steps):
            positions = (starts + step).expand(batch, -1)  # [B, S]
            hidden = decoder.embed_tokens(input_ids.gather(1, positions))  # [B, S, hidden]
            states = [hidden]
            own = []
            for block, layer in enumerate(decoder.layers):
                attention = layer.self_attn
                normed = layer.input_layernorm(hidden)
                head_dim = attention.head_dim
                query = attention.q_proj(normed).unflatten(-1, (-1, head_dim))  # [B, S, H, D]
                key = attention.k_proj(normed).unflatten(-1, (-1, head_dim))  # [B, S, Hkv, D]
                value = attention.v_proj(normed).unflatten(-1, (-1, head_dim))
                cos, sin = self.rotary(normed, positions)
                query, key = query * cos + rotate_half(query) * sin, key * cos + rotate_half(key) * sin
                keys = torch.cat([memory_keys[block], key[:, :, None]], dim=2)  # [B, S, C + i + 1, Hkv, D]
                values = torch.cat([memory_values[block], value[:, :, None]], dim=2)
                seen = torch.cat([context_seen, context_seen.new_ones(len(starts), step + 1)], dim=1)  # [S, C + i + 1]
                grouped = query.unflatten(2, (keys.shape[3], -1))  # [B, S, Hkv, R, D]
                scores = torch.einsum("bshrd,bskhd->bshrk", grouped, keys) * attention.scaling
                scores = scores.masked_fill(~seen[None, :, None, None, :], float("-inf"))
                mixed = torch.einsum("bshrk,bskhd->bshrd", scores.softmax(dim=-1), values)  # [B, S, Hkv, R, D]
                hidden = hidden + attention.o_proj(mixed.flatten(2))
                hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
                states.append(hidden)
                own.append((key, value))
            logits.append(self.model.lm_head(decoder.norm(hidden)))  # [B, S, V]
            if step + 1 < steps:  # this position's keys and values for the block's later tokens
                if self.feedback:
                    memory = self.memory(torch.stack(states, dim=2))  # [B, S, blocks, hidden]
                    own = [self.keys_values(block, memory[:, :, block], positions) for block in range(self.num_blocks)]
                for block, (key, value) in enumerate(own):
                    memory_keys[block] = torch.cat([memory_keys[block], key[:, :, None]], dim=2)
                    memory_values[block] = torch.cat([memory_values[block], value[:, :, None]], dim=2)
        return torch.stack(logits, dim=2)  # [B, S, steps, V]
