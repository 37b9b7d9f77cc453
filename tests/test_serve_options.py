"""`slotwise serve` takes every option either service takes (prep's --threads as
--prep-threads), with the same defaults, and hands each on as that service's own parser would:
its parser is built from the services' definitions, not written again."""

from __future__ import annotations

import argparse
import signal
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from test_cli import start_serve

from clients.client import Message, SlotwiseClient, SlotwiseError
from infer_service import __main__ as infer_main
from infer_service.flags import OPTIONS as INFER
from infer_service.flags import nice_value, spec_types_flag
from infer_service.spec.config import SpecConfig
from prep_service import __main__ as prep_main
from prep_service.flags import OPTIONS as PREP
from slotwise_core.flags import Option, positive_int, settings
from slotwise_serve import serve_command
from support.media import image_bytes
from support.procs import free_port


def unusual(o: Option, tmp_path: Path) -> list[str]:
    """A value for the option that is not its default (its flag alone for a switch)."""
    kw = o.kwargs
    if o.flag == "--spec-synth-len":  # (it goes with no --spec-synth-rates, given below)
        return []
    if o.flag == "--spec-synth-rates":  # (one a draft: --spec-draft-n-max's unusual value)
        return [o.flag, ",".join(["1"] * (SpecConfig().n_max + 3))]
    if kw.get("action") == "store_true":
        return [o.flag]
    if "choices" in kw:
        return [o.flag, next(c for c in reversed(kw["choices"]) if c != kw.get("default"))]
    if kw.get("type") is Path:
        path = tmp_path / o.name
        path.write_text("")
        return [o.flag, str(path)]
    if kw.get("type") in (int, float, positive_int, nice_value):
        return [o.flag, str((kw.get("default") or 0) + 3)]
    if kw.get("metavar") == "FNAME:SCALE":  # (--lora-scaled)
        return [o.flag, f"{tmp_path / o.name}.gguf:0.5"]
    if kw.get("type") is spec_types_flag:  # (one type or several)
        return [o.flag, "ngram-mod,suffix"]
    return [o.flag, f"{o.name}-value"]


@pytest.mark.parametrize("given", ["defaults", "every option"])
def test_serve_hands_each_option_on_as_the_service_would(tmp_path: Path, given: str) -> None:
    infer_argv = [a for o in INFER for a in unusual(o, tmp_path)] if given != "defaults" else []
    prep_argv = [a for o in PREP for a in unusual(o, tmp_path)] if given != "defaults" else []
    model = ["--model", str(tmp_path / "model.gguf")]
    (tmp_path / "model.gguf").write_text("")
    infer_argv = infer_argv or model
    prep_argv = prep_argv or model
    # serve: infer's flags as they are, prep's own ones too (its --threads renamed)
    serve_argv = [*infer_argv]
    prep_own = iter(prep_argv)
    for flag in prep_own:
        value = [] if flag.startswith("--") and not _takes_value(flag) else [next(prep_own)]
        if flag not in serve_command.SHARED:
            serve_argv += [serve_command.PREP_FLAGS.get(flag, flag), *value]
    config = serve_command.config_from(serve_command.parser().parse_args(serve_argv))

    alone_infer = settings(infer_main.parser().parse_args(infer_argv), INFER)
    if given == "defaults":
        alone_prep = settings(prep_main.parser().parse_args(prep_argv), PREP)
    else:  # (serve gives both services one model, projector and message limit: infer's)
        shared = {o.name: alone_infer[o.name] for o in INFER if o.flag in serve_command.SHARED}
        alone_prep = {**settings(prep_main.parser().parse_args(prep_argv), PREP), **shared}
    assert dict(config.infer) == alone_infer
    assert dict(config.prep) == alone_prep
    assert infer_main.start_arguments(config.infer) == infer_main.start_arguments(alone_infer)
    assert prep_main.start_arguments(config.prep) == prep_main.start_arguments(alone_prep)


def _takes_value(flag: str) -> bool:
    (o,) = [o for o in PREP if o.flag == flag]
    return o.kwargs.get("action") != "store_true"


def test_serve_s_drain_default_is_the_services_own() -> None:
    args = serve_command.parser().parse_args(["--model", "m.gguf"])
    for service in (infer_main, prep_main):
        alone = service.parser().parse_args(["--model", "m.gguf"])
        assert args.drain_seconds == alone.drain_seconds == 30.0
    assert serve_command.parser().parse_args(["--model", "m", "--grace", "2"]).drain_seconds == 2


def test_options_given_to_serve_reach_the_running_services(tiny: dict[str, Any]) -> None:
    """Flags `slotwise serve` lacked before it was built from the services' definitions."""
    metrics = free_port()
    pair = tiny["mrope"]
    served = start_serve(
        pair.model, pair.mmproj, "--max-images", "1", "--encode-threads", "1",
        "--infer-metrics-port", str(metrics), "--log-level", "error", "--drain-seconds", "5",
    )  # fmt: skip
    try:
        with SlotwiseClient(served.prep, served.infer) as c:
            one = c.prepare([Message.user(image_bytes(32, 32, seed=1), "one picture")])
            assert one.num_cells > 0
            two = [image_bytes(32, 32, seed=1), image_bytes(32, 32, seed=2)]
            with pytest.raises(SlotwiseError) as refused:  # --max-images 1 reached prep
                c.prepare([Message.user(*two, "two pictures")])
            assert refused.value.code().name == "INVALID_ARGUMENT" and "images" in str(
                refused.value
            )
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics}/metrics", timeout=10) as r:
            assert b"slotwise_infer_capacity_cells" in r.read()  # --infer-metrics-port too
    finally:
        served.process.send_signal(signal.SIGTERM)
        assert served.process.wait(60) == 0


def test_a_file_serve_cannot_find_is_a_usage_error(tmp_path: Path, capsys) -> None:
    assert serve_command.main(["--model", str(tmp_path / "missing.gguf")]) == 2
    assert "no such file" in capsys.readouterr().err
    assert isinstance(serve_command.parser(), argparse.ArgumentParser)


def test_serve_is_reached_through_the_slotwise_command_with_its_options(
    tmp_path: Path, capsys
) -> None:
    import slotwise_cli

    missing = str(tmp_path / "missing.gguf")
    assert slotwise_cli.main(["--log-level", "info", "serve", "--model", missing]) == 2
    assert slotwise_cli.main(["serve", "--model", missing, "--log-level", "info"]) == 2
    assert capsys.readouterr().err.count("slotwise serve: error: no such file") == 2
    with pytest.raises(SystemExit) as refused:  # a count of zero is no count
        slotwise_cli.main(["serve", "--model", missing, "--parallel", "0"])
    assert refused.value.code == 2 and "must be positive" in capsys.readouterr().err
