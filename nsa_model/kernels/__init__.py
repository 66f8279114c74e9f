"""Triton kernels for NSA, one file per op; nsa_model/ops/triton_impl.py wraps them in autograd Functions.

  range_attention.py     attention over a contiguous range of keys per query: the compressed and window branches
  selection.py           block importance + top-n selection, fused, so no T x Tc score ever reaches memory
  selected_attention.py  group-centric attention over the selected blocks, one program per query (forward, dQ);
                         dK/dV through an inverted index (padded heads; kept selectable as slc_dkdv="inverted")
  selected_tiled.py      selected attention forward and dQ per tile of queries, walking the union of their blocks
  selected_by_block.py   selected attention driven by key blocks: each program loads one block once for a slice
                         of the queries that chose it (forward partials + combine; one fused backward for dK, dV
                         and dQ); the default for groups of <= 8 heads, and the dK/dV kernel of the other two
  block_index.py         the selected branch's indexes from the selections: segment keys for the sort, the
                         by_block work list, each query tile's union of blocks
  gates.py               the gated combination of the three branches, fused, forward and backward
  delta.py               the backward row term sum(do * o) of every attention branch, one read of each
  rope.py                RoPE over the rows of the attention's q/k/v projection and its split into parts, both
                         ways (outside the NSA core: the attention modules' nsa::rope_split op)
  stats.py               the sums behind NSAAttention's per-call statistics (gates, blocks chosen, their distance),
                         one pass (outside the core: nsa::attention_stat_sums)
  decode.py              a decoding step: one new query over a model's cached buffers, as four small launches
                         (compressed partials, importance, top-n with a selected block or window tile a program,
                         combine); outside the training core: NSAAttention.decode through ops/decode.py

The kernels run on CUDA, or on CPU under Triton's own interpreter (TRITON_INTERPRET=1 set before this package is
imported: triton.jit reads it when a kernel is defined).
"""
