"""Fast attention over packed ragged rows and our KV cache, as a Triton kernel (DESIGN §4).

Invariant: the output equals ``attention.reference_attention`` (causal by cache slot, optional
sliding window; in a tree pass also an ancestor bitmask per query over the 64 slots from its
group's tree start; in a static sparse pass only the sink keys and the group's window), and each
program reads its row's keys and values only up to the row's real length (the largest query
position in its group plus one, from the window's start when there is one): never to the cache's
``max_len``. A sparse pass reads the sink's block and the window's blocks, nothing between.

One program per (group, KV head, block of query rows, share of the keys); a block's query rows
are the group's tokens times the query heads that share the KV head (grouped-query attention),
so decode steps with one to a few tokens per row still fill a matrix-unit tile. With few rows,
each row's keys are read in ``kv_splits`` shares by as many programs (flash-decoding; key
block b goes to share b mod kv_splits), whose partial results ``_combine_kernel`` merges, one
program per (token, query head), summing the shares in share order. A runner uses one count for
every pass (``split_count``), the blocks' assignment does not depend on the pass's other
queries, and an entry's combine reads its own shares only, so a query's output is the same
bitwise whether it is decoded alone or verified in a group, and in every graph bucket. Online
softmax in float32; float32 inputs use IEEE products (no TF32), so greedy decoding stays exact.

Cost of a split pass: three kernels (a memset of the shares' maxima and sums, the attention, the
combine); an unsplit pass: two (the output's zeros, the attention). Neither synchronises with the
host, so both run inside CUDA graphs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _attend_block(q, q_pos, m_i, l_i, acc, k_base, v_base, stride_k_pos, stride_v_pos, offs_d, valid_d, start_n,
                  lower, upper, tree_mask, tree_start, scale, window,
                  BLOCK_N: tl.constexpr, IEEE: tl.constexpr, TREE: tl.constexpr):
    """One block of BLOCK_N keys from ``start_n`` into the online softmax (m_i, l_i, acc): only
    keys in [lower, upper) are read and seen, each by the queries its rules let see it."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    in_range = (offs_n >= lower) & (offs_n < upper)
    k = tl.load(k_base + offs_n[None, :] * stride_k_pos + offs_d[:, None],
                mask=in_range[None, :] & valid_d[:, None], other=0.0)  # [D, N]
    if IEEE:
        scores = tl.dot(q, k, input_precision="ieee")
    else:
        scores = tl.dot(q, k)
    scores = scores * scale  # [M, N]
    visible = in_range[None, :] & (offs_n[None, :] <= q_pos[:, None])
    if TREE:  # keys below the tree start causally, tree keys by their bit in the query's mask
        offset = offs_n - tree_start  # [N]
        bit = (tree_mask[:, None] >> tl.minimum(tl.maximum(offset, 0), 63)[None, :].to(tl.int64)) & 1
        visible = visible & ((offset < 0)[None, :] | ((offset < 64)[None, :] & (bit == 1)))
    if window > 0:
        visible = visible & (offs_n[None, :] > q_pos[:, None] - window)
    scores = tl.where(visible, scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp(scores - m_safe[:, None])
    alpha = tl.exp(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    v = tl.load(v_base + offs_n[:, None] * stride_v_pos + offs_d[None, :],
                mask=in_range[:, None] & valid_d[None, :], other=0.0)  # [N, D]
    if IEEE:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


# the kernel's integer arguments that vary from pass to pass (they scale with its token count, or
# with the query's layout: the rotary output of a one-token pass has token stride head_dim, not
# heads x head_dim): Triton would otherwise compile a variant per divisibility of each by 16, on
# first sight, which stalls a serving engine for about half a second the first time one runs
@triton.jit(do_not_specialize=["stride_q_token", "stride_q_head", "stride_p_split", "window"])
def _packed_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr,
    token_positions_ptr, group_rows_ptr, group_first_token_ptr, group_counts_ptr,
    tree_mask_ptr, group_tree_start_ptr, group_sink_end_ptr, group_window_start_ptr,
    part_out_ptr, part_ml_ptr,
    stride_q_token, stride_q_head,
    stride_k_row, stride_k_head, stride_k_pos,
    stride_v_row, stride_v_head, stride_v_pos,
    stride_o_token, stride_o_head,
    stride_p_split, stride_p_token, stride_p_head,
    scale, window,
    HEADS_PER_KV: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr, TREE: tl.constexpr, SPARSE: tl.constexpr,
    SPLITS: tl.constexpr,
):
    group = tl.program_id(0)
    kv_head = tl.program_id(1).to(tl.int64)
    m_block = tl.program_id(2) // SPLITS
    split = tl.program_id(2) % SPLITS  # which contiguous share of the row's keys this program reads
    count = tl.load(group_counts_ptr + group)
    if m_block * BLOCK_M < count * HEADS_PER_KV:
        first_token = tl.load(group_first_token_ptr + group)
        cache_row = tl.load(group_rows_ptr + group).to(tl.int64)
        offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)  # query rows: token-major, then head
        valid_m = offs_m < count * HEADS_PER_KV
        token = first_token + offs_m // HEADS_PER_KV
        head = kv_head * HEADS_PER_KV + offs_m % HEADS_PER_KV
        offs_d = tl.arange(0, BLOCK_D)
        valid_d = offs_d < HEAD_DIM
        q = tl.load(q_ptr + token[:, None] * stride_q_token + head[:, None] * stride_q_head + offs_d[None, :],
                    mask=valid_m[:, None] & valid_d[None, :], other=0.0)  # [M, D]
        q_pos = tl.load(token_positions_ptr + token, mask=valid_m, other=0)  # [M] cache slots
        tree_mask = q_pos
        tree_start = 0
        if TREE:
            tree_mask = tl.load(tree_mask_ptr + token, mask=valid_m, other=0)  # [M] int64 bits over tree slots
            tree_start = tl.load(group_tree_start_ptr + group)
        kv_len = tl.max(tl.where(valid_m, q_pos, 0), axis=0) + 1
        lowest = tl.min(tl.where(valid_m, q_pos, kv_len), axis=0) - window + 1  # first key a window lets in
        kv_start = tl.where(window > 0, tl.maximum(lowest, 0) // BLOCK_N * BLOCK_N, 0)

        k_base = k_cache_ptr + cache_row * stride_k_row + kv_head * stride_k_head
        v_base = v_cache_ptr + cache_row * stride_v_row + kv_head * stride_v_head
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        lower = 0
        if SPARSE:  # the sink keys first (by the first split), then only the window: nothing between is read
            sink_end = tl.load(group_sink_end_ptr + group)  # <= the window start
            for start_n in range(kv_start, tl.where(split == 0, sink_end, kv_start), BLOCK_N):
                m_i, l_i, acc = _attend_block(q, q_pos, m_i, l_i, acc, k_base, v_base, stride_k_pos, stride_v_pos,
                                              offs_d, valid_d, start_n, 0, sink_end, tree_mask, tree_start, scale,
                                              window, BLOCK_N, IEEE, TREE)
            lower = tl.load(group_window_start_ptr + group)
            kv_start = tl.maximum(kv_start, lower // BLOCK_N * BLOCK_N)
        # the key blocks from kv_start on, block b to share b % SPLITS (flash-decoding): by absolute block
        # index, so a query's sum runs in one order whatever the other queries of its pass (blocks
        # past its own slot add exact zeros)
        first = kv_start + ((split - kv_start // BLOCK_N) % SPLITS + SPLITS) % SPLITS * BLOCK_N
        for start_n in range(first, kv_len, BLOCK_N * SPLITS):
            m_i, l_i, acc = _attend_block(q, q_pos, m_i, l_i, acc, k_base, v_base, stride_k_pos, stride_v_pos,
                                          offs_d, valid_d, start_n, lower, kv_len, tree_mask, tree_start, scale,
                                          window, BLOCK_N, IEEE, TREE)
        if SPLITS == 1:
            out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
            tl.store(out_ptr + token[:, None] * stride_o_token + head[:, None] * stride_o_head + offs_d[None, :],
                     out.to(out_ptr.dtype.element_ty), mask=valid_m[:, None] & valid_d[None, :])
        else:  # this share's unnormalised output, running max and sum, combined by _combine_kernel
            entry = split * stride_p_split + token * stride_p_token + head * stride_p_head  # [M] (share, token, head)
            tl.store(part_out_ptr + entry[:, None] * BLOCK_D + offs_d[None, :], acc,
                     mask=valid_m[:, None] & valid_d[None, :])
            tl.store(part_ml_ptr + 2 * entry, m_i, mask=valid_m)
            tl.store(part_ml_ptr + 2 * entry + 1, l_i, mask=valid_m)


def packed_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    token_positions: torch.Tensor,
    group_rows: torch.Tensor,
    group_first_token: torch.Tensor,
    group_counts: torch.Tensor,
    max_group_tokens: int,
    scaling: float,
    sliding_window: int | None = None,
    tree_mask: torch.Tensor | None = None,
    group_tree_start: torch.Tensor | None = None,
    group_sink_end: torch.Tensor | None = None,
    group_window_start: torch.Tensor | None = None,
    kv_splits: int = 1,
) -> torch.Tensor:
    """query: [N, H, D] (last dim contiguous); keys/values: cache [R, Hkv, L, D];
    token_positions: [N] cache slots; group_rows, group_first_token, group_counts: [G];
    tree_mask [N] and group_tree_start [G] for a tree pass, group_sink_end and
    group_window_start [G] for a static sparse pass (AttentionMetadata); kv_splits: programs per
    row and head, each reading a share of the row's keys (split_count) -> output [N, H, D]."""
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = keys.shape[1]
    heads_per_kv = num_heads // num_kv_heads
    if query.stride(-1) != 1:
        query = query.contiguous()
    rows_per_group = max_group_tokens * heads_per_kv
    block_m = 16 if rows_per_group <= 16 else (32 if rows_per_group <= 32 else 64)
    block_d = max(16, triton.next_power_of_2(head_dim))
    splits = kv_splits if num_tokens * num_heads * block_d * 4 * kv_splits <= SPLIT_BUFFER_BYTES else 1
    if splits > 1:
        out, part_out, part_ml = _split_buffers(splits, num_tokens, num_heads, head_dim, block_d, query)
    else:  # zeros: graph filler slots beyond a group's processed rows stay finite
        out = torch.zeros(num_tokens, num_heads, head_dim, dtype=query.dtype, device=query.device)
        part_out = part_ml = out  # unused
    grid = (group_rows.shape[0], num_kv_heads, triton.cdiv(rows_per_group, block_m) * splits)
    _packed_attention_kernel[grid](
        query, keys, values, out,
        token_positions, group_rows, group_first_token, group_counts,
        token_positions if tree_mask is None else tree_mask,
        group_rows if group_tree_start is None else group_tree_start,
        group_rows if group_sink_end is None else group_sink_end,
        group_rows if group_window_start is None else group_window_start,
        part_out, part_ml,
        query.stride(0), query.stride(1),
        keys.stride(0), keys.stride(1), keys.stride(2),
        values.stride(0), values.stride(1), values.stride(2),
        out.stride(0), out.stride(1),
        num_tokens * num_heads, num_heads, 1,
        scaling, sliding_window or 0,
        HEADS_PER_KV=heads_per_kv, HEAD_DIM=head_dim, BLOCK_D=block_d,
        BLOCK_M=block_m, BLOCK_N=64, IEEE=query.dtype == torch.float32, TREE=tree_mask is not None,
        SPARSE=group_window_start is not None, SPLITS=splits,
        num_warps=4,
    )
    if splits > 1:
        combine_shares(part_out, part_ml, out)
    return out


SPLIT_BUFFER_BYTES = 256 * 1024**2  # a pass whose shares would need more (a long prefill) runs unsplit
MIN_SHARE = 128  # keys a share should have at least, in a row of the cache's full length (read by split_count)


def _split_buffers(splits: int, num_tokens: int, num_heads: int, head_dim: int, block_d: int,
                   query: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The output and the shares' buffers of a split pass. Only the maxima and sums start
    initialised (zeros, one memset): every program of a group writes its share of each of its
    query rows, a sum of 0 marking a share that saw no key, so a token in no group (graph filler)
    keeps sum 0 in every share, and the combine writes every entry of the output."""
    device = query.device
    out = torch.empty(num_tokens, num_heads, head_dim, dtype=query.dtype, device=device)  # [N, H, D]
    part_out = torch.empty(splits, num_tokens, num_heads, block_d, dtype=torch.float32, device=device)  # [S, N, H, Dp]
    part_ml = torch.zeros(splits, num_tokens, num_heads, 2, dtype=torch.float32, device=device)  # [S, N, H, 2]
    return out, part_out, part_ml


# the number of entries scales with the pass's token count: not specialised (see _packed_attention_kernel)
@triton.jit(do_not_specialize=["num_entries"])
def _combine_kernel(part_out_ptr, part_ml_ptr, out_ptr, num_entries,
                    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, SPLITS: tl.constexpr):
    """One entry (token, query head): its SPLITS shares' unnormalised outputs [Dp], running maxima
    and sums, summed in share order (float32) into the normalised output, stored in out's dtype. A
    share whose sum is 0 saw no key (or was never written) and adds nothing: its output is not
    read. An entry no share saw gets zeros."""
    entry = tl.program_id(0).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    valid_d = offs_d < HEAD_DIM
    top = tl.full([], float("-inf"), tl.float32)  # the largest maximum among shares that saw a key
    for split in tl.static_range(SPLITS):
        share = split * num_entries + entry
        maximum, total = tl.load(part_ml_ptr + 2 * share), tl.load(part_ml_ptr + 2 * share + 1)
        top = tl.where(total > 0.0, tl.maximum(top, maximum), top)
    top = tl.where(top == float("-inf"), 0.0, top)  # no share saw a key: every weight is 0 below
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    denominator = tl.zeros([], dtype=tl.float32)
    for split in tl.static_range(SPLITS):
        share = split * num_entries + entry
        maximum, total = tl.load(part_ml_ptr + 2 * share), tl.load(part_ml_ptr + 2 * share + 1)
        seen = total > 0.0
        weight = tl.where(seen, tl.exp(maximum - top), 0.0)  # 1 for the top share
        seen_d = tl.zeros([BLOCK_D], dtype=tl.float32) + total > 0.0  # [Dp] (Triton's interpreter mis-splats a scalar)
        partial = tl.load(part_out_ptr + share * BLOCK_D + offs_d, mask=valid_d & seen_d, other=0.0)  # [Dp]
        acc += weight * partial
        denominator += weight * total
    out = acc / tl.where(denominator == 0.0, 1.0, denominator)
    tl.store(out_ptr + entry * HEAD_DIM + offs_d, out.to(out_ptr.dtype.element_ty), mask=valid_d)


def combine_shares(part_out: torch.Tensor, part_ml: torch.Tensor, out: torch.Tensor) -> None:
    """part_out [S, N, H, Dp] unnormalised outputs and part_ml [S, N, H, 2] running max and sum of
    S shares of each row's keys -> out [N, H, D] (contiguous, any float dtype), every entry
    written. Cost: one kernel, one program per (token, head), reading S * (Dp + 2) floats each."""
    splits, num_tokens, num_heads, block_d = part_out.shape
    num_entries = num_tokens * num_heads
    if num_entries == 0:
        return
    _combine_kernel[(num_entries,)](part_out, part_ml, out, num_entries, HEAD_DIM=out.shape[-1], BLOCK_D=block_d,
                                    SPLITS=splits, num_warps=max(1, min(4, block_d // 128)))


def split_count(max_rows: int, kv_heads: int, max_len: int, device: torch.device) -> int:
    """Shares per (row, KV head) for a runner's passes: enough programs to fill the GPU twice over
    when rows are few, each share at least MIN_SHARE keys of a full-length row; a power of two.
    One count per runner (not per pass): every bucket of its graphs then sums in the same order."""
    if device.type != "cuda":
        return 1
    processors = torch.cuda.get_device_properties(device).multi_processor_count
    programs = max(1, max_rows * kv_heads)
    splits = 1
    while programs * splits * 2 <= 2 * processors and max_len // (splits * 2) >= MIN_SHARE:
        splits *= 2
    return splits


_compiled: set[tuple] = set()  # the shapes compile_variants has run for in this process


def compile_variants(num_heads: int, num_kv_heads: int, head_dim: int, max_len: int, kv_splits: int,
                     dtype: torch.dtype, device: torch.device) -> None:
    """Compile the kernel's variants a causal pass of a runner of this shape may take (one per
    block of query rows: 16, 32 or 64, by the pass's largest group; with the combine when it
    splits), and the cache write's (triton_cache), now rather than on first sight, which costs
    about half a second: in a serving engine, a row that catches up a few tokens after idle steps
    would otherwise stall every request in flight. Runs each on one scratch group (a cache row of
    zeros of the runner's length, so the strides are the runner's); once per shape and process."""
    key = (num_heads, num_kv_heads, head_dim, max_len, kv_splits, dtype, str(device))
    if key in _compiled:
        return
    from .triton_cache import store_kv

    heads_per_kv = num_heads // num_kv_heads
    cache = torch.zeros(1, num_kv_heads, max_len, head_dim, dtype=dtype, device=device)  # [1, Hkv, L, D]
    for tokens in sorted({min(1 + rows // heads_per_kv, max_len) for rows in (0, 16, 32)}):
        # laid out as a model's attention hands it over: [1, N, H, D] projected, viewed as [1, H, N, D]
        query = torch.zeros(1, tokens, num_heads, head_dim, dtype=dtype, device=device).transpose(1, 2)[0].transpose(0, 1)
        index = torch.zeros(1, dtype=torch.int64, device=device)
        positions = torch.arange(tokens, device=device)
        new_keys = query[:, :num_kv_heads].transpose(0, 1)  # [Hkv, N, D], strided as a model's keys
        store_kv(cache, cache, torch.zeros_like(positions), positions, new_keys, new_keys)
        packed_attention(query, cache, cache, positions, index, index,
                         torch.full((1,), tokens, dtype=torch.int64, device=device), tokens, 1.0, None,
                         kv_splits=kv_splits)
    _compiled.add(key)
