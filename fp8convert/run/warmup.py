"""torch and CUDA loaded in the background.

Importing torch and creating a CUDA context take seconds (more with cold files). A thread does it while
the main thread goes on with what needs neither (preparing OUT, copying kept tensors, reading ahead),
and the pipeline's own `import torch` then finds it done, or waits for the rest.
"""
from __future__ import annotations

import threading


class TorchWarmup(threading.Thread):
    """The loading thread; `imported` is set once `import torch` is done (CUDA may still be starting)."""

    def __init__(self, device: str):
        super().__init__(name="fp8convert-torch", daemon=True)
        self.device = device
        self.imported = threading.Event()

    def run(self) -> None:
        try:
            import torch
            self.imported.set()
            if self.device != "cpu" and torch.cuda.is_available():
                torch.empty(1, device="cuda" if self.device == "auto" else self.device)
        except Exception:  # noqa: BLE001 - reported by the pipeline, which tries again
            pass
        finally:
            self.imported.set()


def start_torch(device: str) -> TorchWarmup:
    """Import torch and, unless `device` is the CPU, start CUDA on it. Failures are left for the
    pipeline to report in its own words, when it resolves the device."""
    thread = TorchWarmup(device)
    thread.start()
    return thread
