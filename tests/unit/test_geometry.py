"""KVGeometry: the one home of the window-in-pages rule, checked against its definition (which
positions a sliding layer reads) for every window/page-size pair, and handed unchanged to every user."""
import pytest
from hypothesis import given, strategies as st

from storage.geometry import KVGeometry


@given(st.integers(1, 40), st.integers(1, 300), st.integers(1, 2000))
def test_page_rules_follow_from_the_positions_a_sliding_layer_reads(ps, window, n):
    g = KVGeometry(ps, window, (0,), (1,))
    # A continuation at a page boundary p reads positions [p - W + 1, p): exactly window_pages pages
    # when p is far enough from 0.
    p = (window // ps + 2) * ps
    read = {pos // ps for pos in range(p - window + 1, p)}
    assert len(read) == g.window_pages
    assert g.swa_pages_bound == g.window_pages + 1
    # The first decode step after a prompt of n tokens reads [n - W + 1, n).
    assert g.swa_lo(n) == max(0, n - window + 1)
    assert g.swa_needed_first_page(n) == g.swa_lo(n) // ps
    assert g.swa_aligned_first_page(n) <= g.swa_needed_first_page(n)
    n_full, first, n_swa = g.plan_pages(n)
    assert n_full * ps >= n > (n_full - 1) * ps and first + n_swa == n_full
    assert first == g.swa_aligned_first_page(n)
    assert g.cacheable_tokens(n) % ps == 0 and g.cacheable_tokens(n) <= n - 1


def test_no_sliding_layers_means_no_window_and_no_swa_pages():
    g = KVGeometry.from_layers(["full_attention"] * 4, 4096, 16)
    assert not g.has_swa and g.window is None and g.window_pages == 0 and g.swa_pages_bound == 0
    assert g.plan_pages(100) == (7, 0, 0) and g.swa_lo(100) == 0
    hybrid = KVGeometry.from_layers(["sliding_attention"] * 5 + ["full_attention"], 512, 16)
    assert hybrid.swa_layers == (0, 1, 2, 3, 4) and hybrid.full_layers == (5,) and hybrid.window_pages == 32


def test_bad_geometry_is_refused_naming_the_field():
    with pytest.raises(ValueError, match="page_size"):
        KVGeometry(0, 8)
    with pytest.raises(ValueError, match="window"):
        KVGeometry(16, 0)
    with pytest.raises(ValueError, match="need a window"):
        KVGeometry(16, None, (), (0,))
    with pytest.raises(ValueError, match="prompt_len"):
        KVGeometry(16, 64).plan_pages(0)


def test_the_engine_hands_one_geometry_to_scheduler_tree_and_leases():
    from engine import Engine
    eng = Engine.from_pretrained("strata-tiny", page_size=8, num_pages=128, enable_prefix_cache=True)
    g = eng.geometry
    assert g == KVGeometry.from_layers(eng.model_config.layer_types, 64, 8)
    assert eng.scheduler.geom is g and eng.cache.geom is g
    assert eng.cache.tree.window_pages == g.window_pages == 8
