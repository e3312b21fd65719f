"""tsckpt.integrations: the package imports no framework until one of its modules is imported."""

from __future__ import annotations

import pytest


@pytest.mark.slow
def test_importing_tsckpt_imports_no_framework():
    """In a fresh process: tsckpt, tsckpt.torch and the integrations package import no framework."""
    import subprocess
    import sys

    code = (
        "import sys, tsckpt, tsckpt.torch, tsckpt.integrations; "
        "print(sorted(m for m in ('pytorch_lightning', 'lightning', 'accelerate', 'torchtitan') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
