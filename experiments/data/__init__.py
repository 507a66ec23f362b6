"""What the pipeline reads: the target (:mod:`.target`), its tokenizer recipe (:mod:`.tokenizer`), the
training corpora (:mod:`.corpora`), the evaluation suites (:mod:`.suites`), prompt rendering and
batching (:mod:`.prompts`), decontamination (:mod:`.decontamination`) and stable hashes (:mod:`.hashing`)."""
