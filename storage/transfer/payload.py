"""The prompt KV one request hands from prefill to decode (``KVPayload``), and its wire form: raw byte
arrays that pickle protocol 5 sends out of band."""
from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch


@dataclass
class KVPayload:
    """What a backend moves: the prompt KV one request hands from prefill to decode, as the prefill
    engine exports it (engine/disagg.py ``export_kv``).

    full: [full_layers, ceil(prompt_len / page_size), page_elems], logical pages [0, n_full)
    swa:  [swa_layers, n_swa, page_elems], logical pages [swa_first_page, swa_first_page + n_swa)
    """

    prompt_len: int
    first_token: int
    page_size: int
    full: torch.Tensor
    swa: torch.Tensor
    swa_first_page: int
    swa_valid_from: int = 0   # first position whose SWA KV the payload holds
    # The prompt's leading whole pages the sender's own cache offloads (its write-through) to the L3 store
    # ``offloaded_to`` (L3Store.location): a receiver offloading to the same store skips them rather than
    # moving them a second time.
    offloaded_pages: int = 0
    offloaded_to: str = ""

    @property
    def nbytes(self) -> int:
        return self.full.numel() * self.full.element_size() + self.swa.numel() * self.swa.element_size()

    def __reduce__(self):
        # Pickled (ray_object's object store, a Ray call's argument) with its KV as raw byte arrays: NumPy
        # arrays go out of band under pickle protocol 5 (Ray's zero-copy path), where a torch tensor is
        # pickled through torch's own storage serialisation, ~0.1 ms a tensor each way on a CPU (1.5-2 ms of
        # a P/D request's CPU, py-spy, session 20).
        return (_payload_from_wire, (self.prompt_len, self.first_token, self.page_size, _to_wire(self.full),
                                     _to_wire(self.swa), self.swa_first_page, self.swa_valid_from,
                                     self.offloaded_pages, self.offloaded_to))


def _to_wire(t: torch.Tensor) -> tuple:
    """(bytes as a uint8 NumPy array, dtype name, shape) of ``t`` (copied to the host if it is not there)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    return t.contiguous().reshape(-1).view(torch.uint8).numpy(), str(t.dtype).removeprefix("torch."), tuple(t.shape)


def _from_wire(raw, dtype: str, shape: tuple) -> torch.Tensor:
    with warnings.catch_warnings():
        # Ray hands zero-copy arrays over the object store read-only; the KV is only read (copied into
        # the leased pages), never written.
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(raw).view(getattr(torch, dtype)).reshape(shape)


def _payload_from_wire(prompt_len: int, first_token: int, page_size: int, full: tuple, swa: tuple,
                       swa_first_page: int, swa_valid_from: int, offloaded_pages: int = 0,
                       offloaded_to: str = "") -> KVPayload:
    return KVPayload(prompt_len, first_token, page_size, _from_wire(*full), _from_wire(*swa), swa_first_page,
                     swa_valid_from, offloaded_pages, offloaded_to)
