"""A small learnable language-modelling task shared by the Trainer tests and the 2-process worker: the next token is
the previous one plus one (mod vocab), with a little noise."""
import jax
import numpy as np
import optax

from tests import toy_models as tm

VOCAB, SEQ = 64, 16
MODEL = tm.LlamaLike(vocab=VOCAB, d=32, n_layers=2)


def make_examples(n, seed=0):
    rs = np.random.RandomState(seed)
    out = []
    for _ in range(n):
        s = [rs.randint(VOCAB)]
        for _ in range(SEQ):
            s.append((s[-1] + 1) % VOCAB if rs.rand() < 0.9 else rs.randint(VOCAB))
        out.append({"token_ids": s})
    return out


def collate_fn(examples):
    t = np.array([e["token_ids"] for e in examples], np.int32)
    return {"input_ids": t[:, :-1], "labels": t[:, 1:]}


def loss_fn(params, batch, rng, is_training):
    logits = MODEL.apply({"params": params}, batch["input_ids"])
    loss = optax.softmax_cross_entropy_with_integer_labels(logits.astype(np.float32), batch["labels"]).mean()
    return loss, {"accuracy": (logits.argmax(-1) == batch["labels"]).mean()}


def init_params(seed=0):
    return MODEL.init(jax.random.key(seed), np.zeros((1, SEQ), np.int32))["params"]
