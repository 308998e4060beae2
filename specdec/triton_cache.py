"""The KV cache write of ``cache.store`` as one Triton kernel, for caches on a GPU.

Invariant: writes exactly what the torch version of ``cache.store`` writes: token n's key and
value of every KV head at (token_rows[n], head, token_positions[n]) of the layer's caches, in the
caches' dtype, and nothing else. Cost: one launch for keys and values together, one program per
(token, KV head) copying one key and one value of head_dim each, in place of two advanced-indexing
writes. No host synchronisation: it runs inside CUDA graphs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


# the input's strides vary with its token count and layout (a pass of one token is often laid out
# otherwise), and the index and input pointers with where they sit in a packed transfer or a merged
# projection (fusion.py; not always 16-byte aligned): not specialised, so no new variant is compiled
# mid-decoding (see triton_attention)
@triton.jit(do_not_specialize=["token_rows_ptr", "token_positions_ptr", "keys_ptr", "values_ptr", "stride_k_head",
                               "stride_k_token", "stride_v_head", "stride_v_token"])
def _store_kernel(
    key_cache_ptr, value_cache_ptr, token_rows_ptr, token_positions_ptr, keys_ptr, values_ptr,
    stride_kc_row, stride_kc_head, stride_kc_pos,
    stride_vc_row, stride_vc_head, stride_vc_pos,
    stride_k_head, stride_k_token, stride_v_head, stride_v_token,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Token program_id(0)'s key and value of KV head program_id(1) into both caches."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    row = tl.load(token_rows_ptr + token).to(tl.int64)
    position = tl.load(token_positions_ptr + token).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    valid_d = offs_d < HEAD_DIM
    key = tl.load(keys_ptr + head * stride_k_head + token * stride_k_token + offs_d, mask=valid_d)  # [Dp]
    value = tl.load(values_ptr + head * stride_v_head + token * stride_v_token + offs_d, mask=valid_d)  # [Dp]
    key_slot = key_cache_ptr + row * stride_kc_row + head * stride_kc_head + position * stride_kc_pos
    value_slot = value_cache_ptr + row * stride_vc_row + head * stride_vc_head + position * stride_vc_pos
    tl.store(key_slot + offs_d, key.to(key_cache_ptr.dtype.element_ty), mask=valid_d)
    tl.store(value_slot + offs_d, value.to(value_cache_ptr.dtype.element_ty), mask=valid_d)


def fits(key_cache: torch.Tensor, value_cache: torch.Tensor, token_rows: torch.Tensor, token_positions: torch.Tensor,
         keys: torch.Tensor, values: torch.Tensor) -> bool:
    """Whether the kernel takes these tensors: the indices [N] contiguous and on the caches'
    device (index_put also takes them from the host), the others' last dimension contiguous."""
    return (token_rows.stride(0) == token_positions.stride(0) == 1
            and token_rows.device == token_positions.device == key_cache.device
            and key_cache.stride(-1) == value_cache.stride(-1) == keys.stride(-1) == values.stride(-1) == 1)


def store_kv(key_cache: torch.Tensor, value_cache: torch.Tensor, token_rows: torch.Tensor,
             token_positions: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
    """Write keys and values [Hkv, N, D] into one layer's caches [R, Hkv, L, D] at (token_rows[n],
    :, token_positions[n]), [N] each (strides as ``fits`` allows).
    Launched on the caches' GPU (Triton launches on the current one)."""
    num_kv_heads, num_tokens, head_dim = keys.shape
    if num_tokens == 0:
        return
    if key_cache.is_cuda and key_cache.device.index != torch.cuda.current_device():  # a layer on another GPU
        with torch.cuda.device(key_cache.device):
            return store_kv(key_cache, value_cache, token_rows, token_positions, keys, values)
    _store_kernel[(num_tokens, num_kv_heads)](
        key_cache, value_cache, token_rows, token_positions, keys, values,
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        keys.stride(0), keys.stride(1), values.stride(0), values.stride(1),
        HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim), num_warps=1,
    )
