"""The stages of the pipeline, each a function with typed settings, called by the entry points, by
``experiments.main`` and by each other where a stage chains the next:

* :mod:`.regeneration` (``regenerate``, ``ensure_data``): the target answers the training prompts;
* :mod:`.training` (``train``; :mod:`.trainer`: the Trainer and callbacks from config): a block drafter;
* :mod:`.evaluation` (``evaluate_suite``, ``evaluate``, ``run_evaluation``, ``evaluate_training_run``;
  :mod:`.settings`: :class:`~.settings.DecodingSettings`; :mod:`.eval_drafters`: what is evaluated);
* :mod:`.export`: a trained drafter in the DFlash serving format;
* :mod:`.records`: results.json and the run folders' records;
* :mod:`.main_job`: the README's main job, stage after stage; :mod:`.choose_k`: its stage that picks each
  baseline's K and each drafter's verified width on held-out training answers (:mod:`.timing`: a primed drafter);
* :mod:`.assistant`, :mod:`.target_training`, :mod:`.target_quality`: the shipped AR assistant and tiny target.
"""
