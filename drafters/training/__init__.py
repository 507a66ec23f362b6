"""Training a drafter, apart from the model: the regenerated data and its DataModule (:mod:`.datamodule`), the
target-feature cache (:mod:`.features`), batching and resumable loading (:mod:`.batching`), the training vocabulary
(:mod:`.vocab`), random-stream resume (:mod:`.resume`), one step's inputs (:mod:`.blocks`), the LightningModule
(:mod:`.module`), its validation metrics (:mod:`.validation`), the schedule (:mod:`.optim`) and the pickling
workarounds of ``ddp_spawn`` (:mod:`.compat`). Imports Lightning and datasets: the model side never imports it."""
