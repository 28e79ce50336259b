"""The layers the code keeps: protocol cores and the session loop import without torch, and
nothing below the transports imports them."""

import subprocess
import sys


def imports_torch(*modules: str) -> bool:
    code = f"import sys, {', '.join(modules)}; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return out.stdout.strip() == "True"


def test_protocol_cores_and_the_session_loop_run_without_torch():
    assert not imports_torch("duplex.transport.realtime.protocol",
                             "duplex.transport.twilio.protocol", "duplex.transport.loop",
                             "duplex.session", "duplex.engine.scheduler", "duplex.engine.client")


def test_access_and_models_sit_below_the_transports():
    code = ("import sys, duplex.access.auth, duplex.access.limits, models.base, models.echo; "
            "print(sorted(m for m in sys.modules if m.startswith('duplex.transport')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
