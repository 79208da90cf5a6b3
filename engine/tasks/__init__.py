"""The applications built on the engine core: text data (`text_data`), causal language modelling (`lm`),
sequence-to-sequence pairs (`seq2seq`), RLHF (`rlhf`: SFT and DPO rows, reward models, PPO and GRPO), plans of named
model configs (`planning`) and the scripts' shared flags and helpers (`cli`).

The core (`engine.*` outside this package) never imports a task or a model family; tasks import both.
"""
