"""Training on CPU: the loop every phalanx trainer shares, and `phalanx train-eagle`, which trains
an EAGLE-1 / EAGLE-3 draft head for any target phalanx serves by self-distillation.

Modules: ``loop`` (schedule, optimizer steps, checkpoints), ``head`` (the head as a PyTorch module and
its on-disk format), ``objective`` (EAGLE's loss with the training-time test), ``prompts`` (prompt
sets), ``distill`` (the target's answers and features), ``features`` (batches from the feature
shards), ``eagle`` (the stages of `train-eagle`), ``cli`` (its flags).
Importing this package imports nothing heavy.
"""
