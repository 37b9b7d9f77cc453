"""The AMX probe: on VMs that report AMX, llama.cpp's AMX kernels crash the first Q4_K decode
(ggml_backend_amx_mul_mat); such a host loads without extra buffer types unless told to."""

from __future__ import annotations

import pytest

from slotwise_core import native


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
    # AMX reported: off either way (it crashed on hosts of both kinds), the reason says which
    use, why = native.extra_bufts_decision({"amx_tile", "amx_int8"}, granted)
    assert use is False and "grants" in why and asked
    use, why = native.extra_bufts_decision({"amx_tile"}, lambda: False)
    assert use is False and "refuses" in why


@pytest.mark.skipif("amx_tile" not in native.cpu_flags(), reason="this CPU reports no AMX")
def test_the_real_probe_on_a_cpu_that_reports_amx() -> None:
    granted = native.amx_tile_permission()
    use, why = native.extra_bufts_decision(native.cpu_flags(), native.amx_tile_permission)
    assert use is False
    assert ("grants" in why) is granted
