"""Stage 3, run: read -> quantize -> write, overlapped, with bounded memory."""
