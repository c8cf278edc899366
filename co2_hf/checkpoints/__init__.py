"""CO2's checkpoints, framework-neutral: the Trainer (``integrations/trainer.py``) and Accelerate
(``integrations/accelerate.py``) save and resume through these modules alike. Pure torch: importing
the package loads neither transformers nor accelerate (tests/test_imports.py).

One module per job, each importing only those listed before it (and ``co2_hf.config``,
``co2_hf.core``):

- ``bounded.py``: what ``torch.load`` may read from a checkpoint file, checked before it reads it;
- ``manifest.py``: ``co2_manifest.json``, every file's size and SHA-256: written, read, verified;
- ``agreement.py``: every rank refuses a checkpoint when one does, and resumes from the same one;
- ``publish.py``: a save staged beside its target and renamed into place once complete, durably;
- ``config_file.py``: ``co2_config.json``, the settings and the world that ran them;
- ``rank_files.py``: each rank's ``co2_rank{r}.pt``, the checks before resuming, the anchor as
  saved, and `rank_files.saving`, one whole save as both frameworks make it;
- ``elastic.py``: resuming on another world size (``--co2_elastic``).
"""
