"""The baselines' attention kernels: :mod:`.varlen_attention` (every path on its own,
packed; :mod:`.varlen_attention_flash` runs it on flash-attn) and
:mod:`.tree_mask_attention` (one sequence per tree under a tree mask)."""
