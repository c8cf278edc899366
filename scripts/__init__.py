"""The repository's benchmarks and research tools; not part of the installed library.

``pip install co2_hf`` installs ``co2_hf`` only (pyproject.toml: ``packages.find`` includes
``co2_hf*``). What is here measures or studies CO2 and depends on the library's public API alone:
the simulated-worker harness (``sim.py``) and the sweeps built on it, the overlap and slow-link
benchmarks (``bench_overlap.py``, ``bandwidth/`` behind ``bench_bandwidth.py``), the analytic
``scaling_model.py``, ``gpu_overhead.py``, the soak, the recipe comparison.

Every file is run from anywhere as ``python scripts/<name>.py ...`` (the commands in README.md and
docs/) and every module is imported as ``scripts.<name>`` from the repository root, which is how the
tests import them (``python -m pytest`` puts the root on ``sys.path``; pyproject.toml's pytest
``pythonpath`` does the same for a bare ``pytest``). A runnable file that imports another module of
this package puts the repository root on ``sys.path`` first when it is run as a file, the one place
where a path is edited.
"""
