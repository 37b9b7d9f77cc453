"""The AMX probe: a CPU that reports AMX inside a VM that refuses AMX tile data would crash the
first Q4_K decode in ggml_backend_amx_mul_mat; such a host loads without extra buffer types."""

from __future__ import annotations

import pytest

from prep_service import native


def test_the_decision() -> None:
    asked: list[bool] = []

    def granted() -> bool:
        asked.append(True)
        return True

    assert native.extra_bufts_decision({"avx2", "fma"}, granted) == (
        True,
        "the CPU reports no AMX",
    )
    assert not asked  # no AMX: the kernel is not even asked
    assert native.extra_bufts_decision({"amx_tile", "amx_int8"}, granted)[0] is True
    use, why = native.extra_bufts_decision({"amx_tile"}, lambda: False)
    assert use is False and "refuses AMX tile data" in why


@pytest.mark.skipif("amx_tile" not in native.cpu_flags(), reason="this CPU reports no AMX")
def test_the_real_probe_on_a_cpu_that_reports_amx() -> None:
    granted = native.amx_tile_permission()
    use, why = native.extra_bufts_decision(native.cpu_flags(), native.amx_tile_permission)
    assert use is granted
    assert ("grants" in why) is granted
