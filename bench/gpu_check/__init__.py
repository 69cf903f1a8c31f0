"""One prepared check of strata on a GPU: the copy kernels, the engine and the L1/L2 tiers on CUDA, with
figures against the hardware's limits. Every part that a GPU decides skips on a machine without one
(naming why), and ``--device cpu`` runs the same code on the CPU at small sizes, so the check is
exercised in CI before a GPU is ever at hand (tests/unit/test_gpu_check.py, with Ray, llguidance,
Mooncake, NIXL and the compiled token helper blocked from importing: the GPU image has none of them).

    python -m bench.gpu_check [--parts env,kernels,bandwidth,engine,speed] [--out DIR] [--device auto|cuda|cpu]
    make gpu-check [GPU_CHECK_PARTS=kernels,engine] [GPU_CHECK_OUT=DIR]

Parts (each runs alone, so a failed one can be rerun by name):

* ``env``: the device, the software stack (torch, Triton, transformers, nvcc) and what imports.
* ``kernels``: every copy kernel (CUDA and Triton; three L2 layouts; both directions; all layers or one;
  scattered pages and runs; L2 pinned on the host or on the device; bf16, fp32 and narrow-vector page
  shapes) against its ``ref_*`` torch oracle, bit for bit over the whole destination tensor.
* ``bandwidth``: L1 <-> L2 page moves of a Llama-3-8B-shaped KV page (32 layers, 8 KV heads, head 128,
  page 16, bf16: 64 KiB per layer-page) through each backend, against the host link (one contiguous
  pinned copy of the same bytes) and against one ``cudaMemcpyAsync`` (``copy_``) per contiguous chunk.
* ``engine``: greedy tokens of each family's tiny checkpoint on the device against transformers (the
  oracle, on the CPU) and against the engine on the CPU, under the numerics policy (tests/numerics.py):
  cold, from L1, from L2 (loaded back on the copier's own stream, layer by layer, beside the forward),
  and prefill on one engine with decode on another (through the cluster's leased admission, tests/pd.py).
  Also a seeded sampled request with penalties, bias and logprobs, and the pools' integrity after each.
* ``speed``: a Gemma-3-1B-shaped model (26 layers, 5 sliding : 1 full, random bf16 weights): prefill
  tokens/s, decode tokens/s at batch 1, 8 and 64 against the memory-bandwidth bound (weight and KV
  bytes one step reads / the device's measured copy bandwidth), where a decode step's time goes (kernels
  launched, the device's busy share), and the time to first token of an L2 hit (with and without the
  layer-wise overlap) against an L1 hit and against recomputing the prefix.

One module per part (env.py, copy_kernels.py, bandwidth.py, families.py, speed.py) over checks.py
(named pass/fail results, timing); __main__.py runs the parts asked for and reports. A part imports
what it needs when it runs, so one whose imports fail on a machine fails alone. Writes
``gpu_check.json`` into the output folder (``--out``, else ``$GPU_CHECK_OUT``, else
bench/results/gpu_check) after each part and prints a table per part. Exit status 1 when a part failed.
"""
PARTS = ("env", "kernels", "bandwidth", "engine", "speed")
