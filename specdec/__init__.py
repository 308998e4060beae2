"""specdec: composable, lossless speculative decoding for Hugging Face causal LMs.

    from specdec import generate, SamplingParams
    from specdec.drafters import ModelDrafter, PromptLookupDrafter
    from specdec.verifiers import PaddingFreeVerifier
    from specdec.policies import FixedPolicy

    out = generate(target, prompts, drafter=ModelDrafter(small), policy=FixedPolicy(4))
    out.sequences, out.stats
"""

from . import drafters, policies, verifiers
from .engine import Engine, FinishedRequest
from .generate import GenerateOutput, generate
from .pipeline import PipelinedEngine
from .runner import UnsupportedModelError
from .stats import GenerationStats, RequestStats
from .types import PAD_ID, SamplingParams

__version__ = "0.1.0"

__all__ = [
    "generate",
    "GenerateOutput",
    "Engine",
    "FinishedRequest",
    "PipelinedEngine",
    "GenerationStats",
    "RequestStats",
    "SamplingParams",
    "UnsupportedModelError",
    "PAD_ID",
    "drafters",
    "policies",
    "verifiers",
]
