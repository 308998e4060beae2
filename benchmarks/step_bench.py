"""Plain-decoding step time through specdec's runner on one GPU, by mode, against the floor.

Random-weight Llama shapes (only time is measured), bf16, context 512, batch 1 and 16:
reference attention eager, fast attention eager, fast attention with CUDA graphs. Floor =
(weight bytes + KV bytes read) / copy bandwidth measured in the same run.

    python benchmarks/step_bench.py --out results.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from specdec import generate
from specdec.policies import FixedPolicy

SHAPES = {
    "llama-1B": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                     num_key_value_heads=8, vocab_size=128256),
    "llama-8B": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                     num_key_value_heads=8, vocab_size=128256),
}
CONTEXT, NEW_TOKENS = 512, 64


def copy_bandwidth() -> float:
    source = torch.empty(2 * 1024**3, dtype=torch.uint8, device="cuda")
    target = torch.empty_like(source)
    for _ in range(3):
        target.copy_(source)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(20):
        target.copy_(source)
    torch.cuda.synchronize()
    return 2 * source.numel() * 20 / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out")
    parser.add_argument("--shapes", default="llama-1B,llama-8B")
    args = parser.parse_args()
    bandwidth = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    results = []
    for name in args.shapes.split(","):
        config = LlamaConfig(max_position_embeddings=4096, bos_token_id=None, eos_token_id=None, pad_token_id=None, **SHAPES[name])
        with torch.device("cuda"):
            model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
        weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        kv_per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * (config.hidden_size // config.num_attention_heads) * 2
        for batch in (1, 16):
            prompts = [[(7 * i + j) % 1000 for j in range(CONTEXT)] for i in range(batch)]
            floor_ms = (weight_bytes + batch * (CONTEXT + NEW_TOKENS // 2) * kv_per_token) / bandwidth * 1e3
            for mode, kwargs in (("reference eager", dict(attention="reference")),
                                 ("fast eager", dict(attention="fast")),
                                 ("fast + CUDA graphs", dict(attention="fast", cuda_graphs=True))):
                run = lambda: generate(model, prompts, policy=FixedPolicy(0), max_new_tokens=NEW_TOKENS, **kwargs)  # noqa: E731
                run()  # warm-up (captures graphs once)
                out = run()
                decode_s = out.stats.wall_time_s - out.stats.prefill_time_s
                step_ms = decode_s / out.stats.steps * 1e3
                row = {"shape": name, "batch": batch, "mode": mode, "step_ms": step_ms, "floor_ms": floor_ms,
                       "fraction_of_floor": floor_ms / step_ms, "tokens_per_s": batch * out.stats.steps / decode_s}
                results.append(row)
                print(f"{name:>9} batch {batch:>3} {mode:>20}: {step_ms:7.2f} ms/step (floor {floor_ms:.2f} ms, "
                      f"{row['fraction_of_floor']:.0%}), {row['tokens_per_s']:8.1f} tok/s", flush=True)
        del model
        torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "copy_bandwidth_bytes_per_s": bandwidth, "context": CONTEXT, "new_tokens": NEW_TOKENS,
                       "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
