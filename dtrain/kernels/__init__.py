"""Hand-written GPU kernels for the pointwise work Inductor's generated code does slowly: RoPE
(``rope``) and the cross-entropy loss (``cross_entropy``). Each is a ``torch.library`` custom op
with its own backward, so it runs the same eager and inside compiled blocks; on the CPU (and
where Triton is missing) it computes the PyTorch reference. The Triton code is in ``gpu``,
imported only when a CUDA tensor needs it (CPU installs have no Triton)."""
