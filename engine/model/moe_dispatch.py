"""How routed tokens reach their expert slots and come back: the dispatch interface of the MoE layer.

``TorchDispatch`` (the default in one process) computes every slot in this process:
a dense path (every slot on every token; cheaper than per-expert dispatch for tiny experts) and a
per-slot path. Both combine a token's k contributions in choice order (sum over k of w[t, k] * y), so
the output does not depend on which slot, i.e. which replica, served each choice.

``DeepEPDispatch`` sends tokens to the ranks that own their slots over DeepEP's all-to-all kernels (GPU
clusters with NVLink/RDMA). It is built only where ``import deep_ep`` works and a torch.distributed
group is up; ``select_dispatch`` falls back to torch with a log line otherwise. ``DeepEPLowLatencyDispatch``
uses DeepEP's low-latency (decode) kernels. Neither has run on the machines strata is developed on (no
GPU, no deep_ep build): both are written to DeepEP's documented interface and stay import-guarded.

Across processes (an EP group, engine/ep.py) engine/model/moe_ep.py's ``AllToAllDispatch`` runs the same
interface over a torch.distributed group handed in from above (gloo here, NCCL on GPU), and
``cross_process_dispatch`` picks DeepEP instead where it is usable.

Shapes: T tokens, H hidden, K choices per token, N weight rows (slots; N = E logical experts when the
layer has no slots).
"""
from __future__ import annotations

import importlib
import logging

import torch

log = logging.getLogger("strata.moe")

# Below this many expert weight elements (all slots) every slot runs on every token in three batched
# ops: for tiny models per-expert dispatch costs far more in op overhead than the wasted FLOPs.
DENSE_MAX_ELEMS = 1 << 21

BACKENDS = ("auto", "torch", "deep_ep", "deep_ep_ll")  # ll: in one process, as deep_ep


def swiglu(gu: torch.Tensor, limit: float, alpha: float) -> torch.Tensor:
    """GPT-OSS's clamped SwiGLU on interleaved gate/up [..., 2I] -> [..., I]."""
    gate = gu[..., ::2].clamp(max=limit)
    up = gu[..., 1::2].clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def activate(gu: torch.Tensor, experts) -> torch.Tensor:
    """The experts' activation on interleaved gate/up [..., 2I] -> [..., I]: GPT-OSS's clamped SwiGLU,
    or silu(gate) * up (Qwen3-MoE)."""
    if experts.act == "silu":
        return torch.nn.functional.silu(gu[..., ::2]) * gu[..., 1::2]
    return swiglu(gu, experts.limit, experts.alpha)


class Dispatch:
    """Runs the experts of one MoE layer on routed tokens."""

    name = "base"

    def __call__(self, x: torch.Tensor, slot: torch.Tensor, weight: torch.Tensor, experts) -> torch.Tensor:
        """x [T, H], slot [T, K] weight rows of ``experts``, weight [T, K] router scores -> [T, H]."""
        raise NotImplementedError


class TorchDispatch(Dispatch):
    """Everything in this process. ``dense``: None picks by size (DENSE_MAX_ELEMS), True/False force."""

    name = "torch"

    def __init__(self, dense: bool | None = None) -> None:
        self.dense = dense

    def __call__(self, x: torch.Tensor, slot: torch.Tensor, weight: torch.Tensor, experts) -> torch.Tensor:
        dense = self.dense
        if dense is None:
            dense = experts.gate_up_proj.numel() + experts.down_proj.numel() <= DENSE_MAX_ELEMS
        return self._dense(x, slot, weight, experts) if dense else self._per_slot(x, slot, weight, experts)

    @staticmethod
    def _dense(x, slot, weight, ex) -> torch.Tensor:
        """Every slot on every token [N, T, H], then each token picks its K rows."""
        # Batched matmuls (x broadcast over the slots), not einsum: the same products bitwise, without
        # einsum's per-call planning, which costs more than the product itself at a decode step's size.
        gu = torch.matmul(x, ex.gate_up_proj) + ex.gate_up_proj_bias[:, None, :]            # [N, T, 2I]
        y = torch.matmul(activate(gu, ex), ex.down_proj) + ex.down_proj_bias[:, None, :]    # [N, T, H]
        picked = y[slot, torch.arange(x.shape[0], device=x.device)[:, None]]          # [T, K, H]
        return (picked * weight[..., None].to(y.dtype)).sum(1).to(x.dtype)

    @staticmethod
    def _per_slot(x, slot, weight, ex) -> torch.Tensor:
        """Each slot runs once on the (token, choice) pairs routed to it; one row per pair."""
        T, K = slot.shape
        flat = slot.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=ex.gate_up_proj.shape[0])
        w = weight.reshape(-1)
        rows = x.new_zeros(T * K, x.shape[1])
        start = 0
        for s, n in enumerate(counts.tolist()):
            if n == 0:
                continue
            pairs = order[start:start + n]
            rows[pairs] = (ex.expert(s, x[pairs // K]) * w[pairs, None]).to(x.dtype)
            start += n
        return rows.view(T, K, -1).sum(1)


class DeepEPDispatch(Dispatch):
    """Expert parallelism over DeepEP (normal kernels): each rank holds ``slots_per_rank`` slots; tokens
    go to the ranks owning their slots, run there, and are combined back weighted by the router.

    Needs ``deep_ep``, CUDA and an initialised torch.distributed process group whose size is the
    layer's rank count; ``experts`` then holds this rank's slots only. Not testable on CPU machines."""

    name = "deep_ep"

    def __init__(self, group=None, num_nvl_bytes: int = 1 << 28) -> None:
        import torch.distributed as dist
        deep_ep = importlib.import_module("deep_ep")
        if not torch.cuda.is_available():
            raise RuntimeError("DeepEP needs CUDA")
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("DeepEP needs an initialised torch.distributed process group")
        self.group = group or dist.group.WORLD
        self.buffer = deep_ep.Buffer(self.group, num_nvl_bytes, 0)

    def __call__(self, x: torch.Tensor, slot: torch.Tensor, weight: torch.Tensor, experts) -> torch.Tensor:
        local = experts.gate_up_proj.shape[0]
        num_slots = local * self.group.size()
        idx = slot.to(torch.int64)
        per_rank, per_rdma, per_slot, in_rank, _ = self.buffer.get_dispatch_layout(idx, num_slots)
        recv_x, recv_idx, recv_w, _, handle, _ = self.buffer.dispatch(
            x, topk_idx=idx, topk_weights=weight.float(), num_tokens_per_rank=per_rank,
            num_tokens_per_rdma_rank=per_rdma, is_token_in_rank=in_rank, num_tokens_per_expert=per_slot)
        # recv_idx holds local slot ids (-1: that choice went to another rank); combine sums over ranks.
        out = torch.zeros_like(recv_x)
        for s in range(local):
            hit = recv_idx == s                                                    # [T', K]
            tok = hit.any(1).nonzero().squeeze(1)
            if tok.numel():
                w = (recv_w * hit).sum(1)[tok, None].to(recv_x.dtype)
                out[tok] += experts.expert(s, recv_x[tok]) * w
        combined, _, _ = self.buffer.combine(out, handle)
        return combined


class DeepEPLowLatencyDispatch(Dispatch):
    """Expert parallelism over DeepEP's low-latency kernels (decode: small batches, RDMA, fixed-size
    receive buffers of ``max_tokens`` per rank). Each rank receives [S, max_tokens * R, H] rows grouped by
    its local slot with ``recv_count`` [S] valid rows per slot; the combine kernel applies the router
    weights and sums over ranks. Needs ``deep_ep`` with low-latency support, CUDA and the group; never
    run here (no GPU on the machine this was written on), so it follows DeepEP's documented interface."""

    name = "deep_ep_ll"

    def __init__(self, group, num_slots: int, hidden: int, max_tokens: int = 128) -> None:
        deep_ep = importlib.import_module("deep_ep")
        if not torch.cuda.is_available():
            raise RuntimeError("DeepEP needs CUDA")
        self.group, self.num_slots, self.max_tokens = group, num_slots, max_tokens
        R = group.size()
        rdma = deep_ep.Buffer.get_low_latency_rdma_size_hint(max_tokens, hidden, R, num_slots)
        self.buffer = deep_ep.Buffer(group, 0, rdma, low_latency_mode=True, num_qps_per_rank=num_slots // R)

    def __call__(self, x: torch.Tensor, slot: torch.Tensor, weight: torch.Tensor, experts) -> torch.Tensor:
        if x.shape[0] > self.max_tokens:
            raise ValueError(f"DeepEP low-latency: {x.shape[0]} tokens > max_tokens {self.max_tokens}")
        idx = slot.to(torch.int64)
        recv_x, recv_count, handle, _, _ = self.buffer.low_latency_dispatch(
            x, idx, self.max_tokens, self.num_slots, use_fp8=False)
        out = torch.empty_like(recv_x)                                     # [S, max_tokens * R, H]
        for s, n in enumerate(recv_count.tolist()):
            if n:
                out[s, :n] = experts.expert(s, recv_x[s, :n])
        combined, _, _ = self.buffer.low_latency_combine(out, idx, weight.float(), handle)
        return combined.to(x.dtype)


def deep_ep_available() -> tuple[bool, str]:
    """(usable, why not) for DeepEPDispatch on this machine."""
    try:
        importlib.import_module("deep_ep")
    except Exception as e:  # ImportError, or a broken build failing on load
        return False, f"import deep_ep failed ({e.__class__.__name__}: {e})"
    if not torch.cuda.is_available():
        return False, "no CUDA device"
    import torch.distributed as dist
    if not dist.is_available() or not dist.is_initialized():
        return False, "no torch.distributed process group"
    return True, ""


def select_dispatch(backend: str = "auto", dense: bool | None = None, local_ranks: int = 1) -> Dispatch:
    """The dispatch for ``backend`` ("auto": DeepEP where usable, else torch; "torch"; "deep_ep").
    ``local_ranks``: EP ranks this process holds the slots of; DeepEP needs exactly one. DeepEP that
    cannot be used falls back to torch with a log line naming the reason."""
    if backend not in BACKENDS:
        raise ValueError(f"dispatch backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "torch":
        return TorchDispatch(dense)
    ok, why = deep_ep_available()
    if ok and local_ranks != 1:
        ok, why = False, f"this process holds the slots of {local_ranks} ranks; DeepEP needs one per process"
    if ok:
        try:
            return DeepEPDispatch()
        except Exception as e:
            why = f"DeepEP buffer setup failed ({e!r})"
    level = logging.WARNING if backend == "deep_ep" else logging.INFO
    log.log(level, "MoE dispatch: DeepEP unavailable (%s); using the torch path", why)
    return TorchDispatch(dense)
