"""The baselines' attention kernels: :mod:`.varlen_attention` (every path on its own,
packed; its backends by name in :mod:`.varlen_interface`, flash-attn's in
:mod:`.varlen_attention_flash`) and :mod:`.tree_mask_attention` (one sequence per tree
under a tree mask)."""
