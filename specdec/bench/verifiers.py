"""``python -m specdec bench --parts verifiers``: padded, padding-free and decomposed verification
(SPIN's request decomposition, ALGORITHMS.md §2; issue 35) side by side on workloads whose rows
draft different lengths, at every batch size of the run, greedy.

Workloads: "spread", the zoo drafter with every row drafting a length drawn afresh each step,
uniform over 0..SPREAD_MAX (SpreadLengths, seeded); "lookup", prompt lookup at k = SPREAD_MAX
(each row drafts what its context matches). Per (workload, batch, verifier): tok/s (the median
of the timed passes), the padding fraction (pad slots over verified slots), the verify phase's
ms per step, and whether the output is the padded verifier's token for token. DecomposedVerifier
runs at each of PIECE_COSTS. The targets of issue 35, where padded verification wastes over 30%:
some decomposition's padding at most 5%, and the fastest such one's verify step no slower than
padding-free's.
"""

from __future__ import annotations

import numpy as np

from ..drafters import ModelDrafter, PromptLookupDrafter
from ..policies.base import Policy
from ..types import Plan
from ..verifiers import DecomposedVerifier, PaddedVerifier, PaddingFreeVerifier
from .common import BenchSettings, graph_options, timed_generate, zoo_and_prompts

SPREAD_MAX = 6
PIECE_COSTS = (0.0, 0.25, 1.0)  # DecomposedVerifier's: no padding at any width, and two trade-offs
VERIFIERS = {"padded": PaddedVerifier, "padding-free": PaddingFreeVerifier,
             **{f"decomposed {cost:g}": (lambda cost=cost: DecomposedVerifier(cost)) for cost in PIECE_COSTS}}


class SpreadLengths(Policy):
    """Every row drafts a length drawn afresh each step, uniform over 0..max_draft_tokens, with
    drafter 0 (a workload of heterogeneous lengths; a seeded generator, so runs repeat)."""

    def __init__(self, max_draft_tokens: int = SPREAD_MAX, seed: int = 0):
        self._max_draft_tokens = max_draft_tokens
        self._rng = np.random.default_rng(seed)

    @property
    def max_draft_tokens(self) -> int:
        return self._max_draft_tokens

    def plan(self, batch, num_drafters):
        lengths = self._rng.integers(0, self._max_draft_tokens + 1, size=batch.num_rows)  # [B]
        return Plan(drafter_index=np.zeros(batch.num_rows, dtype=np.int64), num_draft_tokens=lengths)


def run_verifiers(settings: BenchSettings, log=print, progress=None) -> dict:
    """-> {"rows": [...], "targets": [...]} (each row: workload, batch, verifier, tokens_per_s,
    padding_fraction, verify_ms, tau, identical, error)."""
    zoo, prompts = zoo_and_prompts(settings)
    target, eos = zoo.target, zoo.tokenizer.eos_token_id
    graphs, compiled = graph_options(settings)
    drafter_name = min(zoo.drafters)
    workloads = {  # name -> (a fresh drafter, a fresh policy for a batch size; None: FixedPolicy(SPREAD_MAX))
        "spread": (lambda: ModelDrafter(zoo.drafters[drafter_name], cuda_graphs=graphs, compile=compiled),
                   lambda batch: SpreadLengths(SPREAD_MAX, seed=batch)),
        "lookup": (PromptLookupDrafter, lambda batch: None)}
    rows: list[dict] = []
    result = {"drafter": drafter_name, "rows": rows}
    for workload, (make_drafter, make_policy) in workloads.items():
        for batch in sorted(settings.batch_sizes, reverse=True):
            chosen = prompts[: settings.batch1_prompts] if batch == 1 else prompts[: max(batch, settings.num_prompts)]
            reference = None
            for name, verifier_class in VERIFIERS.items():
                row = dict(workload=workload, batch=batch, verifier=name, tokens_per_s=float("nan"),
                           padding_fraction=float("nan"), verify_ms=float("nan"), tau=None, identical=None, error="")
                try:
                    details: dict = {}
                    out, seconds, tau = timed_generate(target, chosen, batch, make_drafter(), SPREAD_MAX, settings, eos,
                                                       graphs, compiled, verifier=verifier_class(),
                                                       policy=make_policy(batch), details=details)
                    reference = out if name == "padded" else reference
                    row.update(tokens_per_s=sum(map(len, out)) / seconds, tau=tau,
                               identical=None if reference is None else out == reference,
                               padding_fraction=details["padding_fraction"], verify_ms=1000 * details["verify_s_per_step"])
                except Exception as error:  # noqa: BLE001 - reported in the results, not swallowed
                    row["error"] = f"{type(error).__name__}: {str(error)[:300]}"
                rows.append(row)
                if progress is not None:
                    progress(result)
                log(f"verifiers {workload:<7} batch {batch:>3} {name:<16}"
                    + (f" FAILED {row['error']}" if row["error"] else
                       f" {row['tokens_per_s']:9.1f} tok/s, padding {row['padding_fraction']:.1%}, "
                       f"verify {row['verify_ms']:.2f} ms a step, identical {row['identical']}"))
    result["targets"] = verifier_targets(rows)
    return result


def verifier_targets(rows: list[dict]) -> list[dict]:
    """Issue 35's, per (workload, batch) where padded verification wastes over 30%: some
    decomposition's padding at most 5%, and the fastest of those (or of all, if none) verifying a
    step no slower than padding-free."""
    out = []
    for workload, batch in sorted({(r["workload"], r["batch"]) for r in rows}):
        got = {r["verifier"]: r for r in rows if (r["workload"], r["batch"]) == (workload, batch) and not r["error"]}
        pieces = [r for name, r in got.items() if name.startswith("decomposed")]
        if not {"padded", "padding-free"} <= set(got) or not pieces or not got["padded"]["padding_fraction"] > 0.30:
            continue
        least = min(pieces, key=lambda r: r["padding_fraction"])
        cell = f"{workload}, batch {batch}"
        out.append(dict(target=f"{cell}: decomposed padding <= 5% (padded wastes {got['padded']['padding_fraction']:.0%})",
                        value=round(least["padding_fraction"], 3), detail=least["verifier"],
                        met=least["padding_fraction"] <= 0.05))
        lean = [r for r in pieces if r["padding_fraction"] <= 0.05] or pieces
        fastest = min(lean, key=lambda r: r["verify_ms"])
        packed = got["padding-free"]["verify_ms"]
        ratio = fastest["verify_ms"] / packed if packed > 0 else float("inf")
        out.append(dict(target=f"{cell}: decomposed (padding <= 5%) verify step <= padding-free's",
                        value=round(ratio, 3), detail=fastest["verifier"], met=ratio <= 1.0))
    return out
