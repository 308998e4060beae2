"""``inference``: torch.inference_mode() around a function, entered only where it is not on yet.

The engine's public steps (``Engine.step``, ``Engine.admit``) turn it on once; the runner's
forward pass and the cache's operations, which may be called alone, turn it on themselves. A
decorator ``@torch.inference_mode()`` would build and enter a new context on every call, which
costs the host microseconds a forward pass, several times a decoding step.
"""

from __future__ import annotations

import functools

import torch


def inference(function):
    @functools.wraps(function)
    def within_inference_mode(*args, **kwargs):
        if torch.is_inference_mode_enabled():
            return function(*args, **kwargs)
        with torch.inference_mode():
            return function(*args, **kwargs)
    return within_inference_mode
