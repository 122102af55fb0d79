"""The sections of `bench/gpu_check.py`, one module each, and their registry (`gpu.sections.SECTIONS`).

Imported as the top-level package `gpu` with `bench/` on sys.path (as gpu_check.py sets it), so that the sections
import the bench-level modules (`common`, `label_bench`, `raw_loop`, `train_bench`) as the other benches do."""
