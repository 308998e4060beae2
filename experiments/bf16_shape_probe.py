"""Where the bf16 near-tie comes from: is a target's bf16 output for a row the same whatever the
number of tokens in its forward pass?

The policy runs on the GPU (BENCHMARKS.md, runs 5-23) differ from plain decoding now and then
in bf16 only, when a verification pass of 8-9 tokens a row meets a near-tie that a 1-token plain
step broke the other way; float32 runs never do. This probe measures the two suspects:

1. ``gemm``: one row's product ``x[:1] @ W.T`` against the same row inside products of M rows
   (M = 1 ... 1024), for the target's matrix shapes: the fraction of output elements that differ
   bitwise, per M.
2. ``decode``: a random target of the gpu zoo's shape in bf16 (CUDA graphs, our attention),
   plain greedy decoding against verification of an oracle draft (the plain output itself, k
   tokens a step, so every pass verifies k + 1 tokens a row and every token is accepted unless the
   verification's argmax differs): token agreement per k and batch size.

Each runs with ``torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction`` as given
(--reduced-precision-reduction on|off; torch's default is on), in its own process, since CUDA
graphs keep the cuBLAS kernels chosen at capture.

Found on an H200 (session 19, `benchmarks/results/bf16_shape_probe_h200_*.json`): the GEMMs are
bitwise the same for a row whatever M, and eager CUDA graphs decode identically at every k; with
``--compile``, verification of k = 8 at batch 64 (576 tokens, the runner's largest bucket, 1024)
differed from plain decoding in 29 of 64 rows, k = 6 (bucket 512) in none. ``--capture-order``
tries the next suspects, the compiled variant of the first bucket traced (the largest):
``library`` as is; ``ascending`` runs every bucket once, smallest first, before the capture;
``odd-first`` traces a size no bucket has (the largest bucket less one) first.
``--log-recompiles`` prints why Dynamo compiled each further variant. ``--bucket-logits`` is the
direct test: after the decode probe, the same pass (64 rows of 7 tokens, 448 tokens; and 1 row of
7) replayed through every bucket of the runner that holds it, its logits compared bitwise with the
smallest such bucket's (the fraction of logits and of argmaxes that differ, per bucket).

Session 20 (H200, `benchmarks/results/bf16_shape_probe_h200_compile_{library,ascending}.json`):
with ``library`` (then largest first), bucket 1024 changed 3.7% of the 64x7 pass's logits against
bucket 512, and b64 k = 8 diverged in 29 of 64 rows (k = 6 and 7, and b32 k = 6-8: none); Dynamo
had compiled four variants, the first for bucket 1024 alone (a guard on the token view's stride).
With ``ascending``: two variants (size 1, and sizes 2 and up), every bucket's logits bitwise
equal, no row diverged. ``GraphedForward`` now does this itself (and has no size-1 bucket when
compiled), so ``library`` is the fixed order from then on (`..._compile_fixed.json`: one variant,
no bucket differed, no row diverged); ``ascending`` and ``odd-first`` now only add warm-up passes
before the library's own smallest-first trace, and no longer isolate what they did.

    python experiments/bf16_shape_probe.py --reduced-precision-reduction off --out /tmp/probe_off.json
    python experiments/bf16_shape_probe.py --compile --capture-order odd-first --lengths 6,8 --out /tmp/odd.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from specdec import generate
from specdec.drafters.base import Drafter
from specdec.policies import FixedPolicy
from specdec.types import PAD_ID, Draft


class OracleDrafter(Drafter):
    """Proposes the reference continuation of each row (the target's own plain output)."""

    def __init__(self, references: list[list[int]], first: int = 0):
        self.references, self.first = references, first  # first: the call's first request

    def propose(self, batch, num_tokens: np.ndarray) -> Draft:
        width = int(num_tokens.max(initial=0))
        proposals = np.full((batch.num_rows, width), PAD_ID, dtype=np.int64)  # [B, K]
        counts = np.zeros(batch.num_rows, dtype=np.int64)
        for row in range(batch.num_rows):
            done = int(batch.num_generated[row])
            wanted = self.references[self.first + row][done: done + int(num_tokens[row])]
            proposals[row, : len(wanted)] = wanted
            counts[row] = len(wanted)
        return Draft(token_ids=torch.from_numpy(proposals).to(self._device), num_tokens=counts)

    def start(self, batch, sampling, device, max_draft_tokens) -> None:
        self._device = device


def set_capture_order(order: str) -> None:
    """Run the chosen passes through the (compiled) model before the library's own capture."""
    from specdec.graphs import GraphedForward

    library_capture = GraphedForward._capture_all

    def capture_all(self) -> None:
        if order == "ascending":
            sizes = list(self.buckets)
        elif order == "odd-first":
            sizes = [self.buckets[-1] - 1] if self.buckets[-1] > 2 else []
        else:
            sizes = []
        empty = np.zeros(0, dtype=np.int64)
        for size in sizes:  # tokens outside every group are left unwritten: a warm-up only
            self._fill(None, empty, empty, empty, size)
            self._run_model(size)
        torch.cuda.synchronize()
        library_capture(self)

    GraphedForward._capture_all = capture_all


@torch.inference_mode()
def bucket_logits(target, rows: int, tokens_per_row: int) -> dict:
    """One pass of ``rows`` x ``tokens_per_row`` tokens replayed through each bucket of the
    target's runner that can hold it -> {bucket: {"logits": fraction differing bitwise from the
    smallest bucket's, "argmax": fraction of tokens whose argmax differs}}."""
    from specdec.runner import runners_of

    runner = runners_of(target)["target"]
    graphs = runner.graphs
    counts = np.full(rows, tokens_per_row, dtype=np.int64)
    num_tokens = int(counts.sum())
    starts = np.full(rows, 200, dtype=np.int64)  # positions 200..: inside every row's cache
    row_ids = np.arange(rows, dtype=np.int64)
    input_ids = torch.randint(0, runner.vocab_size, (num_tokens,), generator=torch.Generator().manual_seed(1)).to(runner.device)
    found, first = {}, None
    with runner.attached():
        for bucket in (b for b in graphs.buckets if b >= num_tokens):
            logits = graphs.run(input_ids, row_ids, starts, counts, bucket=bucket).float()  # [N, V] (a copy)
            if first is None:
                first = logits
            found[bucket] = {"logits": float(logits.ne(first).float().mean()),
                             "argmax": float(logits.argmax(-1).ne(first.argmax(-1)).float().mean())}
    torch.cuda.synchronize()
    return found


def gemm_probe(device: str, dtype: torch.dtype) -> dict:
    """Fraction of row 0's outputs that differ bitwise from the 1-row product, per M and shape."""
    generator = torch.Generator(device="cpu").manual_seed(0)
    found = {}
    for inner, outer in ((512, 512), (512, 1536), (1536, 512), (512, 8192)):
        weight = torch.randn(outer, inner, generator=generator).to(device, dtype) / inner ** 0.5
        x = torch.randn(1024, inner, generator=generator).to(device, dtype)
        alone = x[:1] @ weight.T  # [1, outer]
        found[f"{inner}x{outer}"] = {m: float((x[:m] @ weight.T)[:1].ne(alone).float().mean())
                                     for m in (1, 2, 4, 7, 8, 9, 16, 32, 64, 128, 320, 512, 576, 1024)}
    return found


def make_target(device: str, dtype: torch.dtype, vocab: int, layers: int, hidden: int) -> LlamaForCausalLM:
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers,
                         num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=1024,
                         bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # sharpen the random head towards a trained model's spread of logits
        model.get_output_embeddings().weight.mul_(8.0)
    return model.to(device=device, dtype=dtype).eval()


def decode_probe(device: str, dtype: torch.dtype, lengths: list[int], batch_sizes: list[int], prompts: int,
                 new_tokens: int, graphs: bool, compile: bool) -> dict:
    target = make_target(device, dtype, vocab=8192, layers=12, hidden=512)
    rng = np.random.default_rng(0)
    found = {}
    pool = [rng.integers(0, 8192, size=int(rng.integers(100, 300))).tolist() for _ in range(max(prompts, *batch_sizes))]
    options = dict(max_new_tokens=new_tokens, cuda_graphs=graphs, compile=compile)
    # the largest runner first, so one capture (and compilation) serves every later call
    generate(target, pool[: max(batch_sizes)], drafter=OracleDrafter([[0]] * len(pool)), policy=FixedPolicy(max(lengths)),
             **options)
    for batch in sorted(batch_sizes, reverse=True):
        count = max(prompts, batch)
        requests = pool[:count]
        calls = [list(range(i, min(i + batch, count))) for i in range(0, count, batch)]
        references = []
        for call in calls:
            references += generate(target, [requests[i] for i in call], policy=FixedPolicy(0), **options).sequences
        for k in lengths:
            drafter = OracleDrafter(references)
            agreed, diverged = 0, 0
            for call in calls:
                drafter.first = call[0]
                out = generate(target, [requests[i] for i in call], drafter=drafter, policy=FixedPolicy(k), **options)
                for i, sequence in zip(call, out.sequences):
                    same = np.array(sequence) == np.array(references[i])
                    agreed += int(same.sum())
                    diverged += int(not same.all())
            found[f"b{batch} k={k}"] = {"agreement": agreed / (count * new_tokens), "rows_diverged": diverged,
                                        "rows": count}
            print(f"b{batch} k={k}: agreement {agreed / (count * new_tokens):.4f}, {diverged}/{count} rows diverged",
                  flush=True)
    found["_target"] = target
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reduced-precision-reduction", choices=("on", "off"), default="on")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--lengths", default="1,6,7,8")
    parser.add_argument("--batch-sizes", default="1,64")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--capture-order", choices=("library", "ascending", "odd-first"), default="library")
    parser.add_argument("--log-recompiles", action="store_true")
    parser.add_argument("--bucket-logits", action="store_true", help="also replay one pass through every bucket (CUDA)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = args.reduced_precision_reduction == "on"
    if args.capture_order != "library":
        set_capture_order(args.capture_order)
    if args.log_recompiles:
        torch._logging.set_logs(recompiles=True)
    started = time.perf_counter()
    result = {"capture_order": args.capture_order, "reduced_precision_reduction": args.reduced_precision_reduction, "dtype": args.dtype,
              "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
              "torch": torch.__version__, "compile": args.compile,
              "commit": os.environ.get("SPECDEC_COMMIT", ""), "command": " ".join(["python"] + sys.argv)}
    result["gemm"] = gemm_probe(args.device, dtype)
    for shape, by_m in result["gemm"].items():
        print(shape, " ".join(f"{m}:{v:.3f}" for m, v in by_m.items()), flush=True)
    result["decode"] = decode = decode_probe(args.device, dtype, [int(k) for k in args.lengths.split(",")],
                                    [int(b) for b in args.batch_sizes.split(",")], args.prompts, args.new_tokens,
                                    graphs=args.device == "cuda", compile=args.compile)
    result["_target"] = decode.pop("_target")
    if args.bucket_logits:
        target = result.pop("_target")
        result["bucket_logits"] = {f"{rows}x7": bucket_logits(target, rows, 7) for rows in (64, 1)}
        print("bucket logits", result["bucket_logits"], flush=True)
    result.pop("_target", None)
    result["seconds"] = time.perf_counter() - started
    with open(args.out, "w") as handle:
        json.dump(result, handle, indent=1)
    print(f"wrote {args.out} in {result['seconds']:.0f} s")


if __name__ == "__main__":
    main()
