"""um_lab's public surface: one import for what the README uses, errors under one base class."""

from __future__ import annotations

import subprocess
import sys

import um_lab
from um_lab.errors import UmLabError


def test_every_public_name_resolves_and_lives_in_one_module():
    for name in um_lab.__all__:
        value = getattr(um_lab, name)
        assert value is not None, name
    from um_lab.runner import run
    from um_lab.sweep import compare

    assert um_lab.run is run and um_lab.compare is compare
    assert set(um_lab.__all__) <= set(dir(um_lab))


def test_import_um_lab_stays_light():
    code = ("import sys, um_lab; heavy = [m for m in ('um_lab.sim.backend', 'um_lab.runner', 'transformers', "
            "'um_lab.cuda.session') if m in sys.modules]; print(heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_errors_um_lab_raises_on_purpose_share_the_base_class():
    from um_lab.cuda.cupti_source import TelemetryUnavailable
    from um_lab.sizing import SizeRefused

    assert issubclass(TelemetryUnavailable, UmLabError)
    refused = SizeRefused(10 << 30, 1 << 30, "params 10 GiB")
    assert isinstance(refused, um_lab.OversubscriptionRefused) and refused.requested == 10 << 30
    assert refused.cap == 1 << 30 and refused.live == 0 and "does not fit under the safety cap" in str(refused)
    for name in um_lab.__all__:
        value = getattr(um_lab, name)
        if isinstance(value, type) and issubclass(value, Exception):
            assert issubclass(value, UmLabError), name


def test_the_real_backend_path_never_imports_cupy():
    code = ("import sys, um_lab.cuda.session, um_lab.cuda.backend, um_lab.cuda.allocator, um_lab.cuda.telemetry; "
            "print('cupy' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
