"""torch and CUDA loaded in the background.

Importing torch and creating a CUDA context take seconds (more with cold files). A thread does it while
the main thread goes on with what needs neither (preparing OUT, copying kept tensors, reading ahead),
and the pipeline's own `import torch` then finds it done, or waits for the rest.
"""
from __future__ import annotations

import threading


def start_torch(device: str) -> threading.Thread:
    """Import torch and, unless `device` is the CPU, start CUDA on it. Failures are left for the
    pipeline to report in its own words, when it resolves the device."""
    def load() -> None:
        try:
            import torch
            if device != "cpu" and torch.cuda.is_available():
                torch.empty(1, device="cuda" if device == "auto" else device)
        except Exception:  # noqa: BLE001 - reported by the pipeline, which tries again
            pass

    thread = threading.Thread(target=load, name="fp8convert-torch", daemon=True)
    thread.start()
    return thread
