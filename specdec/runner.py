"""ModelRunner: any transformers causal LM over packed ragged tokens, with our cache (DESIGN §4).

Invariant: one forward pass takes the new tokens of any set of rows, each row's tokens a
contiguous run of positions, packed into ``input_ids [1, N]`` with no padding; token n is
placed at (row, position) in our KV cache and attends to its row's cached tokens up to its
position. The logits equal those of the model's own full forward over each row's sequence
(to about 1e-15 in float64).

The model's code is not changed: the runner switches its attention implementation to
specdec's (``attention.py``) while it works (``attached()``) and restores it afterwards, so the
caller's model still works with Hugging Face's ``generate()`` after ours.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from dataclasses import dataclass
from typing import Iterable, Iterator

import numpy as np
import torch

from transformers import PreTrainedModel

from .inference import inference
from .transfer import to_device

from .attention import ATTENTION_NAME, BACKENDS, window_covers_tree
from .attention_metadata import METADATA_KWARG, AttentionMetadata
from . import fusion
from .cache import KVCache
from .hidden_states import HiddenStateTap


class UnsupportedModelError(TypeError):
    """The model cannot run through specdec's runner; the message says why."""


@dataclass
class PackedLayout:
    """Host-side description of one packed forward: group g is ``counts[g]`` tokens of cache
    row ``rows[g]`` at positions ``starts[g] ... starts[g] + counts[g] - 1``."""

    rows: np.ndarray  # [G] int64
    starts: np.ndarray  # [G] int64
    counts: np.ndarray  # [G] int64, each >= 1

    @property
    def num_tokens(self) -> int:
        return int(self.counts.sum())

    def offsets(self) -> np.ndarray:
        """[G+1] cumulative token offsets of the groups (cu_counts)."""
        return np.concatenate([[0], np.cumsum(self.counts)])

    def last_token_indices(self) -> np.ndarray:
        """[G] packed index of each group's last token."""
        return np.cumsum(self.counts) - 1


TREE_MASK_BITS = 64  # tree slots one query's ancestor mask covers (an int64 per token)


@dataclass
class TreeLayout:
    """What makes a packed pass a tree pass (ALGORITHMS.md section 7): token n sits at cache slot
    ``starts[g] + its index in its group`` as usual, but RoPE sees ``positions[n]`` (committed
    length + depth), and it attends to its row's keys below ``tree_starts[g]`` causally and to the
    key at slot ``tree_starts[g] + j`` only if bit j of ``masks[n]`` is set (itself and its
    ancestors). A group with no tree has tree start at the cache's end (plain causal)."""

    positions: torch.Tensor  # [N] int64 on the model's device
    masks: torch.Tensor  # [N] int64 on the model's device
    tree_starts: np.ndarray  # [G] int64, host


def check_tree_layout(layout: PackedLayout, tree: TreeLayout) -> None:
    """A tree pass's host-side shape: one tree start per group, and every tree within the mask's
    reach (the tree slots a group writes lie below tree start + TREE_MASK_BITS)."""
    if tree.tree_starts.shape != layout.rows.shape:
        raise ValueError(f"a tree pass needs one tree start per group: {len(layout.rows)} groups, "
                         f"{len(tree.tree_starts)} tree starts")
    reach = layout.starts + layout.counts - tree.tree_starts  # [G] tree slots up to each group's last token
    if np.any(reach > TREE_MASK_BITS):
        raise ValueError(f"a token tree of {int(reach.max())} nodes does not fit the attention's ancestor masks of "
                         f"{TREE_MASK_BITS} bits: draft trees of at most {TREE_MASK_BITS} nodes")


@dataclass
class ObservedPass:
    """What a runner hands its observers after a dense pass (ModelRunner.observers)."""

    layout: PackedLayout
    hidden: dict  # {index: [N, hidden]} the kept hidden states (hidden_states.HiddenStateTap)
    token_rows: torch.Tensor  # [N] cache row of each packed token, on the model's device
    token_slots: torch.Tensor  # [N] cache slot (= position) of each packed token, on the model's device


@dataclass
class SparseLayout:
    """What makes a packed pass a static sparse one (StreamingLLM's sink + window; MagicDec and
    SPIRe draft with it, ALGORITHMS.md section 8): besides the pass's own causal (or tree) rule, a
    query of group g sees only the keys at slots below ``sink`` and from ``window_starts[g]`` on.
    The fast kernel reads just those keys, so a pass's KV read is sink + window + the tokens it
    feeds, whatever the row's length. A group with window start 0 sees its whole row."""

    sink: int  # the first ``sink`` slots of every row stay visible
    window_starts: np.ndarray  # [G] int64, host: the first slot of each group's window

    @property
    def sink_ends(self) -> np.ndarray:
        """[G] where each group's sink ends (at its window's start if that comes first)."""
        return np.minimum(self.sink, self.window_starts)

    @classmethod
    def trailing(cls, layout: PackedLayout, sink: int, window: int) -> "SparseLayout":
        """The sink plus the last ``window`` slots before each group's first token (and the group's
        own tokens): the draft view of a row whose committed keys end where the pass starts."""
        return cls(sink=sink, window_starts=np.maximum(layout.starts - window, 0))


def check_sparse_layout(layout: PackedLayout, sparse: SparseLayout) -> None:
    if sparse.window_starts.shape != layout.rows.shape:
        raise ValueError(f"a sparse pass needs one window start per group: {len(layout.rows)} groups, "
                         f"{len(sparse.window_starts)} window starts")
    if sparse.sink < 0 or np.any(sparse.window_starts < 0):
        raise ValueError(f"a sparse pass's sink ({sparse.sink}) and window starts must be non-negative")


def vocab_size_of(model: torch.nn.Module) -> int:
    """Number of logits the model produces per token."""
    return model.get_output_embeddings().weight.shape[0]


def weights_fingerprint(model: torch.nn.Module) -> tuple:
    """Changes when the model is moved, cast or given new parameter storage."""
    return tuple((p.device, p.dtype, p.data_ptr()) for p in model.parameters())


def device_of(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def is_split(model: torch.nn.Module) -> bool:
    """Whether the model's parameters sit on more than one device (``device_map``)."""
    return len({p.device for p in model.parameters()}) > 1


def execution_device(module: torch.nn.Module) -> torch.device:
    """Where ``module`` computes: accelerate's hook says so for a dispatched (or offloaded) module,
    else its parameters' device. A dispatched model's own hook moves every tensor argument of its
    forward there, the indices of the logits to keep included."""
    hook = getattr(module, "_hf_hook", None)
    hooks = getattr(hook, "hooks", None) or [hook]  # accelerate's SequentialHook holds several
    devices = [h.execution_device for h in hooks if getattr(h, "execution_device", None) is not None]
    if not devices:
        return next(module.parameters()).device
    device = devices[0]
    return torch.device("cuda", device) if isinstance(device, int) else torch.device(device)


def _hidden_states_to(device: torch.device):
    """A forward hook for a split model's decoder: hands its last hidden state to ``device``, where
    the indices of the logits to keep arrive (the model slices the hidden states with them
    before its head runs, and the head's own hook then moves the slice to the head's device)."""
    def hook(module, args, output):
        if hasattr(output, "last_hidden_state") and output.last_hidden_state.device != device:
            output.last_hidden_state = output.last_hidden_state.to(device)
        return output
    return hook


def check_supported(model: object) -> None:
    """Raise UnsupportedModelError naming why ``model`` cannot run through the runner."""
    if not isinstance(model, PreTrainedModel):
        raise UnsupportedModelError(
            f"expected a transformers causal LM (PreTrainedModel), got {type(model).__name__}"
        )
    name = type(model).__name__
    if getattr(model.config, "is_encoder_decoder", False):
        raise UnsupportedModelError(f"{name} is an encoder-decoder model; specdec needs a decoder-only causal LM")
    if model.get_output_embeddings() is None:
        raise UnsupportedModelError(f"{name} has no language-model head; load it with AutoModelForCausalLM")
    bidirectional = _bidirectional_attention(model)
    if bidirectional:
        raise UnsupportedModelError(
            f"{name} is not a causal decoder: its attention at {bidirectional} is bidirectional "
            "(is_causal=False), so it cannot decode left to right; load a causal LM (AutoModelForCausalLM)"
        )
    text_config = model.config.get_text_config()
    layer_types = set(getattr(text_config, "layer_types", None) or [])
    unsupported = layer_types - {"full_attention", "sliding_attention"}
    if unsupported or getattr(text_config, "attention_chunk_size", None):
        kinds = ", ".join(sorted(unsupported)) or "chunked_attention"
        raise UnsupportedModelError(
            f"{name} has layers of kind {kinds}; specdec's attention backends implement full and "
            "sliding-window causal attention only"
        )
    rope = getattr(text_config, "rope_parameters", None) or getattr(text_config, "rope_scaling", None) or {}
    rope_type = rope.get("rope_type", rope.get("type")) if isinstance(rope, dict) else None
    if rope_type in ("dynamic", "longrope"):
        raise UnsupportedModelError(
            f"{name} uses '{rope_type}' rotary scaling, whose frequencies depend on the longest position in "
            "the whole forward pass: a packed batch would change each row's output"
        )
    if not getattr(model, "_supports_attention_backend", False):
        raise UnsupportedModelError(
            f"{name} does not route its attention through transformers' AttentionInterface "
            "(its class sets _supports_attention_backend=False), so specdec cannot give it a packed KV cache"
        )


def _bidirectional_attention(model) -> str | None:
    """The name of the first attention module of the text decoder that is not causal, or None."""
    try:
        decoder = model.get_decoder()
    except (AttributeError, ValueError, NotImplementedError):
        decoder = model
    for name, module in decoder.named_modules():
        if getattr(module, "is_causal", True) is False:
            return name or type(module).__name__
    return None


def packed_metadata(layout: PackedLayout, cache: KVCache, device: torch.device, backend,
                    tree: TreeLayout | None = None, sparse: SparseLayout | None = None,
                    kv_splits: int = 1, role: str = "") -> AttentionMetadata:
    """Device-side description of a packed pass, shared by every attention layer."""
    counts = layout.counts
    offsets = layout.offsets()
    group_of_token = np.repeat(np.arange(len(counts)), counts)  # [N]
    slot_of_token = np.arange(layout.num_tokens) - np.repeat(offsets[:-1], counts)  # [N]
    max_queries = int(counts.max())
    query_positions = layout.starts[:, None] + np.arange(max_queries)  # [G, Q]
    query_positions = np.where(np.arange(max_queries) < counts[:, None], query_positions, 0)
    to_device_int = lambda array: to_device(np.asarray(array, dtype=np.int64), device)  # noqa: E731
    return AttentionMetadata(
        cache=cache,
        token_rows=to_device_int(layout.rows[group_of_token]),
        token_positions=to_device_int(layout.starts[group_of_token] + slot_of_token),
        token_group=to_device_int(group_of_token),
        token_slot=to_device_int(slot_of_token),
        group_rows=to_device_int(layout.rows),
        group_first_token=to_device_int(offsets[:-1]),
        group_counts=to_device_int(counts),
        group_query_positions=to_device_int(query_positions),
        max_group_tokens=max_queries,
        max_kv_len=int((layout.starts + counts).max()),
        backend=backend,
        token_tree_mask=None if tree is None else tree.masks,
        group_tree_start=None if tree is None else to_device_int(tree.tree_starts),
        tree_pass=tree is not None,
        group_sink_end=None if sparse is None else to_device_int(sparse.sink_ends),
        group_window_start=None if sparse is None else to_device_int(sparse.window_starts),
        kv_splits=kv_splits,
        role=role,
    )


FAST_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _split_count(max_rows: int, kv_heads: int, max_len: int, device: torch.device) -> int:
    from .triton_attention import split_count  # Triton is imported only where the fast backend runs

    return split_count(max_rows, kv_heads, max_len, device)


def reference_only_feature(model) -> str | None:
    """What in ``model``'s attention only the reference backend implements, or None: logit
    soft-capping (Gemma 2) or per-head sink logits (GPT-OSS)."""
    if getattr(model.config.get_text_config(), "attn_logit_softcapping", None) is not None:
        return "attention logit soft-capping (attn_logit_softcapping)"
    if any(isinstance(getattr(module, "sinks", None), torch.Tensor) for module in model.modules()):
        return "attention sink logits (sinks)"
    return None


def resolve_backend(model, attention: str = "auto", cuda_graphs: bool | str = False,
                    compile: bool = False) -> tuple[str, bool, bool]:
    """-> (attention, cuda_graphs, compile). "auto" picks the fast Triton attention for a CUDA
    model in a dtype the kernel takes, and the reference backend otherwise; cuda_graphs="auto"
    follows the fast backend; graphs are otherwise opt-in, since capturing them costs an explicit
    warm-up and memory per bucket. compile fuses the small kernels of the graphed passes with
    torch.compile, so it needs graphs."""
    # one CUDA device: a model split over devices (device_map) runs the reference backend for now
    fast_possible = (not is_split(model) and device_of(model).type == "cuda" and model.dtype in FAST_DTYPES
                     and reference_only_feature(model) is None)
    if attention == "auto":
        attention = "fast" if fast_possible else "reference"
    if cuda_graphs == "auto":
        cuda_graphs = attention == "fast"
    if not isinstance(compile, bool):
        raise TypeError(f"compile must be True or False, got {compile!r}")
    if compile and not cuda_graphs:
        raise ValueError("compile=True fuses the kernels inside the CUDA graphs: pass cuda_graphs=True as well "
                         "(on a CUDA model with attention='fast' or 'auto')")
    return attention, bool(cuda_graphs), compile


_LOCKS: "weakref.WeakKeyDictionary[torch.nn.Module, threading.RLock]" = weakref.WeakKeyDictionary()
_LOCKS_GUARD = threading.Lock()


def model_lock(model: torch.nn.Module) -> threading.RLock:
    """The lock that serialises specdec's use of ``model`` (its runners, caches and attention
    switch), made once per model and dropped with it."""
    with _LOCKS_GUARD:
        lock = _LOCKS.get(model)
        if lock is None:
            lock = _LOCKS[model] = threading.RLock()
        return lock


@contextlib.contextmanager
def models_in_use(models: Iterable[torch.nn.Module]) -> Iterator[None]:
    """Hold the lock of every model a call uses, for the whole call: threads that share a model
    take turns rather than interleave on one cache. Locks are taken in one global order (by id),
    so two calls that use the same models in other roles cannot deadlock; they are re-entrant, so
    a call inside a call (profile() running generate()) on the same thread does not block."""
    unique = {id(model): model for model in models}
    with contextlib.ExitStack() as stack:
        for key in sorted(unique):
            stack.enter_context(model_lock(unique[key]))
        yield


RUNNERS_ATTRIBUTE = "_specdec_runners"
LENGTH_QUANTUM = 256  # cache lengths round up to this on a GPU, so slightly longer calls reuse the runner
CPU_LENGTH_QUANTUM = 32  # on a CPU, where zero-filling a cache of many rows costs more than rebuilding it


class KeptRunners(dict):
    """The runners kept with a model, by role. A copy or a pickle of the model carries none: a
    runner holds the model's cache and captured CUDA graphs, which neither copy nor pickle, and a
    copied model builds its own runners on its first call."""

    def __deepcopy__(self, memo) -> "KeptRunners":
        return KeptRunners()

    def __reduce__(self):
        return KeptRunners, ()


def runners_of(model) -> dict:
    """The runners kept with ``model`` (they live and die with it), by role."""
    return model.__dict__.setdefault(RUNNERS_ATTRIBUTE, KeptRunners())


def release_runners(model) -> None:
    """Release every runner kept with ``model`` now (its caches and captured graphs) and forget
    them: the next call builds new ones (under the settings of that time: fusion.MERGE...)."""
    runners = runners_of(model)
    for runner in runners.values():
        runner.release()
    runners.clear()


def runner_for(model, *, role: str, max_rows: int, max_len: int, attention: str = "reference",
               graph_shape: tuple[int, ...] | None = None, compile: bool = False,
               hidden_layers: tuple[int, ...] = ()) -> "ModelRunner":
    """A runner for ``model`` big enough for the call, reused across calls while it fits (its
    cache and captured graphs stay allocated as long as the model lives).

    role: "target" or "drafter": a model drafting for itself gets a cache of its own per role.
    graph_shape: (max tokens per group, max tokens per pass[, max groups per pass]) to capture CUDA
    graphs for, or None; groups default to one a row (a verifier that cuts rows needs more).
    compile: compile the graphed passes with torch.compile before capturing them.
    hidden_layers: hidden states to keep from every pass (hidden_states.HiddenStateTap).
    """
    runners = runners_of(model)
    quantum = LENGTH_QUANTUM if device_of(model).type == "cuda" else CPU_LENGTH_QUANTUM
    max_len = -(-max_len // quantum) * quantum
    runner = runners.get(role)
    if runner is None or not runner.covers(max_rows, max_len, attention, graph_shape, compile, hidden_layers):
        old = runners.pop(role, None)
        if old is not None:
            old.release()  # now, not whenever the garbage collector gets to it (maybe mid-capture)
        runner = ModelRunner(model, max_rows=max_rows, max_len=max_len, attention=attention,
                             hidden_layers=hidden_layers, role=role)
        if graph_shape is not None:
            runner.enable_graphs(*graph_shape, compile=compile)
        runners[role] = runner
    return runner


class ModelRunner:
    def __init__(self, model: PreTrainedModel, *, max_rows: int, max_len: int, attention: str = "reference",
                 hidden_layers: tuple[int, ...] = (), role: str = ""):
        check_supported(model)
        self.role = role  # what runner_for kept it as ("target", "drafter-0", ...), in every pass's metadata
        if attention not in BACKENDS:
            raise ValueError(f"unknown attention backend {attention!r}; choose one of {sorted(BACKENDS)}")
        self.model = model
        self.device = device_of(model)
        if attention == "fast" and (self.device.type != "cuda" or model.dtype == torch.float64):
            raise ValueError(
                f"the fast attention backend runs on CUDA in float32, bfloat16 or float16; the model is "
                f"{model.dtype} on {self.device}: use attention='reference' there"
            )
        feature = reference_only_feature(model) if attention == "fast" else None
        if feature is not None:
            raise ValueError(f"{type(model).__name__} uses {feature}, which the fast attention backend does not "
                             "implement: use attention='reference' (or 'auto', which picks it for this model)")
        if attention == "fast" and is_split(model):
            raise ValueError("the fast attention backend needs the whole model on one GPU; this one is split over "
                             "several devices (device_map): use attention='reference' (or 'auto')")
        self.vocab_size = vocab_size_of(model)
        # where a split model's forward receives the indices of the logits to keep (accelerate moves
        # them to the model's main device), which may be neither the decoder output's nor the head's
        self.split = is_split(model)
        self.keep_device = execution_device(model) if self.split else self.device
        text_config = model.config.get_text_config()
        self.num_layers = text_config.num_hidden_layers
        # the largest position id the model embeds; only pad slots of a padded layout exceed it
        self.max_position_id = getattr(text_config, "max_position_embeddings", None)
        self.max_rows = max_rows
        self.attention = attention
        # q/k/v and gate/up as one product each where the fast backend runs (fusion.py); before the
        # fingerprint: merging gives the parameters new storage
        merge = fusion.MERGE is True or (fusion.MERGE == "fast" and attention == "fast")
        if merge and fusion.moves_storage(model) and any(
                r.in_use or r.graphs is not None or r.prefill_graph is not None for r in runners_of(model).values()):
            # another runner's captured graphs (or a call in flight) read the parameters where they lie:
            # new storage would free it under them; this runner computes unmerged
            merge = False
        self.merged = fusion.MergedProjections(model) if merge else None
        self.weights_fingerprint = weights_fingerprint(model)
        self.cache = KVCache(self.num_layers, max_rows + 1, max_len)  # + a scratch row for graph filler
        self.backend = BACKENDS[attention]
        kv_heads = getattr(text_config, "num_key_value_heads", None) or text_config.num_attention_heads
        # split-KV shares for the fast kernel: one count for every pass of this runner (triton_attention)
        self.kv_splits = 1 if attention != "fast" else _split_count(max_rows, kv_heads, max_len, self.device)
        if attention == "fast":  # no kernel compiled mid-decoding (triton_attention.compile_variants)
            from .triton_attention import compile_variants

            heads = text_config.num_attention_heads
            head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // heads
            compile_variants(heads, kv_heads, head_dim, max_len, self.kv_splits, model.dtype, self.device)
        self.graphs = None
        self.prefill_graph = None  # GraphedForward of one bucket for prompts (enable_prefill_graph)
        self._checked_layers = False
        self.in_use = False  # a drafter holds it for a call (drafters.model: one runner per drafter in a call)
        # the hidden states kept from every pass, and who hears of each dense pass (observe())
        self.tap = HiddenStateTap(model, hidden_layers) if hidden_layers else None
        self.observers: list = []
        self.graph_passes = 0  # forward passes replayed from a captured graph
        self.eager_passes = 0  # forward passes run eagerly (no graphs, or a pass that fits none)

    def enable_graphs(self, max_group_tokens: int, max_tokens: int, max_groups: int | None = None,
                      compile: bool = False) -> None:
        """Capture CUDA graphs for passes of up to ``max_tokens`` tokens in groups of at most
        ``max_group_tokens`` (and at most ``max_groups`` groups; None: one a row) (the explicit
        warm-up; passes that do not fit run eagerly), after compiling those passes with
        torch.compile when ``compile``."""
        from .graphs import GraphedForward

        if is_split(self.model):
            raise ValueError("CUDA graphs need the whole model on one device; this one is split over several "
                             "(device_map): pass cuda_graphs=False")
        if self.device.type != "cuda" or self.attention != "fast":
            raise ValueError("CUDA graphs need a CUDA model and attention='fast'")
        if compile and self.tap is not None:
            raise ValueError("compile=True cannot keep hidden states (a drafter that reads the target's activations "
                             "asked for them): pass compile=False; CUDA graphs still work")
        self.graphs = GraphedForward(self, max_group_tokens, max_tokens, compile=compile, max_groups=max_groups)
        with self.attached():
            self.graphs.capture()

    def enable_prefill_graph(self, tokens: int) -> None:
        """Capture one CUDA graph for prompt passes of up to ``tokens`` tokens (the prefill's:
        specdec/prefill.py), whatever its groups; every such pass replays it, padded to that
        size, so its products have one shape whatever is admitted. Its head runs on the last slot
        only: a prefill reads no logits. Needs graphs (enable_graphs)."""
        from .graphs import GraphedForward

        if self.graphs is None:
            raise ValueError("a prefill graph goes with the runner's decoding graphs: call enable_graphs first")
        self.prefill_graph = GraphedForward(self, tokens, tokens, one_bucket=True, logits=False)
        with self.attached():
            self.prefill_graph.capture()

    def release(self) -> None:
        """Drop the captured graphs and the cache now. A graph's memory pool freed while another
        graph is being captured invalidates that capture, so replaced runners are released
        explicitly rather than left to the cyclic garbage collector."""
        if self.graphs is not None or self.prefill_graph is not None:
            torch.cuda.synchronize(self.device)
        for graphs in (self.graphs, self.prefill_graph):
            if graphs is not None:
                graphs.release()
        self.graphs = self.prefill_graph = None
        self.cache = KVCache(self.num_layers, 1, 1)

    def covers(self, max_rows: int, max_len: int, attention: str, graph_shape: tuple[int, ...] | None,
               compile: bool = False, hidden_layers: tuple[int, ...] = ()) -> bool:
        """Whether this runner can serve a call of that size (so its cache and graphs are reused)."""
        if self.max_rows < max_rows or self.cache.max_len < max_len or self.attention != attention:
            return False
        if not set(hidden_layers) <= set(() if self.tap is None else self.tap.layers):
            return False  # hooks are part of captured graphs: a runner keeps at least what is asked
        if self.weights_fingerprint != weights_fingerprint(self.model):
            return False  # moved, cast or reloaded since: graphs would replay over stale weights
        if graph_shape is None:
            return self.graphs is None
        groups = graph_shape[2] if len(graph_shape) > 2 else min(graph_shape[1], max_rows)  # real groups a pass
        return (self.graphs is not None and self.graphs.max_group_tokens >= graph_shape[0]
                and self.graphs.max_tokens >= graph_shape[1] and self.graphs.max_groups > groups
                and self.graphs.compiled == compile)

    @contextlib.contextmanager
    def attached(self) -> Iterator["ModelRunner"]:
        """Route the model's attention to specdec (and eval mode) for the duration."""
        previous_attention = self.model.config._attn_implementation
        was_training = self.model.training
        self.model.set_attn_implementation(ATTENTION_NAME)
        self.model.eval()
        decoder = self.model.base_model
        hook = None
        if self.split and decoder is not self.model:
            hook = decoder.register_forward_hook(_hidden_states_to(self.keep_device))
        tap = self.tap if self.tap is not None else contextlib.nullcontext()
        merged = self.merged.installed() if self.merged else contextlib.nullcontext()
        try:
            with tap, merged:
                yield self
        finally:
            if hook is not None:
                hook.remove()
            self.model.set_attn_implementation(previous_attention)
            self.model.train(was_training)

    @inference
    def forward(
        self, input_ids: torch.Tensor, layout: PackedLayout, logits_indices: np.ndarray | None = None,
        tree: TreeLayout | None = None, sparse: SparseLayout | None = None, prefill: bool = False,
    ) -> torch.Tensor:
        """Run the packed tokens and return their logits.

        input_ids: [N] on the model's device, grouped as ``layout`` says; logits_indices: packed
        indices whose logits are wanted (all when None); tree: the positions and ancestor masks
        of a tree pass; sparse: the sink and window starts of a static sparse pass; prefill: a
        pass of prompts, replayed from the prefill graph where it fits
        -> logits [len(logits_indices) or N, V].
        The cache's lengths are left to the caller (it knows which tokens it commits to).
        """
        if layout.num_tokens == 0:
            raise ValueError("a forward pass needs at least one token")
        last_position = int((layout.starts + layout.counts).max())
        if last_position > self.cache.max_len:
            raise ValueError(
                f"position {last_position - 1} does not fit the cache of {self.cache.max_len} positions"
            )
        if logits_indices is not None and np.array_equal(logits_indices, np.arange(layout.num_tokens)):
            logits_indices = None  # every token's logits, in order: no gather needed
        if tree is not None:
            check_tree_layout(layout, tree)
        if sparse is not None:
            check_sparse_layout(layout, sparse)
        graphs = self.prefill_graph if prefill else self.graphs
        if graphs is not None and graphs.fits(layout.counts):
            if tree is not None:  # the attention checks eager passes itself; a replay runs no Python
                window_covers_tree(last_position, self.cache.smallest_window)
            self.graph_passes += 1
            logits = graphs.run(input_ids, layout.rows, layout.starts, layout.counts, tree=tree,
                                sparse=sparse)  # valid until the next replay
            num_tokens = layout.num_tokens
            self._observe(layout, tree, sparse, graphs.token_rows[:num_tokens], graphs.positions[:num_tokens])
            return logits if logits_indices is None else logits[to_device(logits_indices, self.device)]
        self.eager_passes += 1
        meta = packed_metadata(layout, self.cache, self.device, self.backend, tree, sparse, self.kv_splits, self.role)
        keep = 0 if logits_indices is None else to_device(logits_indices, self.keep_device)
        position_ids = meta.token_positions if tree is None else tree.positions
        if self.max_position_id is not None:
            position_ids = position_ids.clamp(max=self.max_position_id - 1)
        output = self.model(
            input_ids=input_ids[None],
            position_ids=position_ids[None],
            use_cache=False,
            logits_to_keep=keep,
            **{METADATA_KWARG: meta},
        )
        if not self._checked_layers:
            self._check_every_layer_ran()
        self._observe(layout, tree, sparse, meta.token_rows, meta.token_positions)
        return output.logits[0].to(self.device)  # the head may sit on another device (device_map)

    @inference
    def greedy_chains(self, first_ids: torch.Tensor, rows: np.ndarray, starts: np.ndarray,
                      num_passes: int) -> torch.Tensor | None:
        """Continue greedy chains by ``num_passes`` single-token passes from the captured greedy
        feeds (GraphedForward.run_greedy_feeds): rows[r] is fed first_ids[r] ([R] on the device)
        at position starts[r], then each pass's argmax -> the argmax tokens [R, num_passes]; None
        when the feeds cannot run them (no such graphs, a pass that fits none, observers that
        must hear each pass). The cache's lengths are left to the caller."""
        graphs = self.graphs
        if (graphs is None or not graphs.greedy_feeds or self.observers or self.tap is not None
                or not graphs.fits(np.ones(len(rows), dtype=np.int64))
                or int(starts.max()) + num_passes > self.cache.max_len):
            return None
        self.graph_passes += num_passes
        return graphs.run_greedy_feeds(first_ids, rows, starts, num_passes)

    def _observe(self, layout: PackedLayout, tree: TreeLayout | None, sparse: SparseLayout | None,
                 token_rows: torch.Tensor, token_slots: torch.Tensor) -> None:
        """Hand every observer a dense causal pass (a prefill or a chain's verification) as an
        ObservedPass, with the pass's own device tensors of rows and slots. Sparse passes (a
        drafter's own, through this runner) and tree passes (slots are not positions there) are not
        handed."""
        if self.observers and tree is None and sparse is None:
            seen = ObservedPass(layout, {} if self.tap is None else self.tap.latest, token_rows, token_slots)
            for observer in self.observers:
                observer(seen)

    def _check_every_layer_ran(self) -> None:
        written = self.cache.layers_written()
        if written != self.num_layers:
            raise UnsupportedModelError(
                f"{type(self.model).__name__} ran specdec's attention in {written} of its "
                f"{self.num_layers} layers; models with layers that keep other state (recurrent or "
                "state-space layers) cannot run with specdec's cache"
            )
        self._checked_layers = True
