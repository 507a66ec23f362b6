"""The jobs that run the stages in turn, each stage as its own entry point: the main job (:mod:`.main_job`,
``python -m experiments.main``) and the long job (:mod:`.long_job`, ``python -m experiments.long``). They sit above
:mod:`experiments.pipeline`, :mod:`experiments.serving` and :mod:`experiments.reporting`, which never import them."""
