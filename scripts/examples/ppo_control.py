"""PPO (Schulman et al. 2017) on CartPole, with the cart-pole physics written here in JAX.

RedCoast's loop: collect a batch of episodes with the current policy, turn them into training examples (actions,
their old log-probabilities, GAE advantages, returns), then `trainer.fit(examples, n_epochs=k)` on the same Trainer,
again each iteration: `n_epochs` counts from each call, so every call trains k more epochs, and the step, compiled
once, is reused however many transitions an iteration brings. The episodes run as one compiled `lax.scan` over
time for all environments at once. RedCoast's version (examples/reinforcement_learning, PPO) steps a gymnasium
environment one action at a time and keeps actor and critic in two Trainers; here one model has both heads.

  XLA_FLAGS=--xla_force_host_platform_device_count=8 python scripts/examples/ppo_control.py
"""
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import engine

MAX_STEPS = 200  # an episode's length limit (CartPole-v0's), so the best return is 200


def cartpole_step(state, push_right):
    """One 20 ms Euler step of the cart-pole (Barto, Sutton and Anderson 1983; gymnasium's constants). state: [4]
    (cart position, cart velocity, pole angle, pole angular velocity); push_right: bool. Returns the next state and
    whether the episode ended (cart beyond 2.4 m or pole beyond 12 degrees)."""
    gravity, cart_mass, pole_mass, half_length, force_size, dt = 9.8, 1.0, 0.1, 0.5, 10.0, 0.02
    x, x_dot, angle, angle_dot = state
    force = jnp.where(push_right, force_size, -force_size)
    cos, sin = jnp.cos(angle), jnp.sin(angle)
    total_mass = cart_mass + pole_mass
    common = (force + pole_mass * half_length * angle_dot ** 2 * sin) / total_mass
    angle_acc = (gravity * sin - cos * common) / (half_length * (4 / 3 - pole_mass * cos ** 2 / total_mass))
    x_acc = common - pole_mass * half_length * angle_acc * cos / total_mass
    new = jnp.stack([x + dt * x_dot, x_dot + dt * x_acc, angle + dt * angle_dot, angle_dot + dt * angle_acc])
    return new, (jnp.abs(new[0]) > 2.4) | (jnp.abs(new[2]) > 12 * np.pi / 180)


class ActorCritic(nn.Module):
    """observations [B, 4] -> (action logits [B, 2], state values [B]); no shared layers, so the value loss cannot
    disturb the policy's features."""

    @nn.compact
    def __call__(self, obs):
        policy = nn.Dense(2)(nn.tanh(nn.Dense(64)(nn.tanh(nn.Dense(64)(obs)))))
        value = nn.Dense(1)(nn.tanh(nn.Dense(64)(nn.tanh(nn.Dense(64)(obs)))))
        return policy, value[:, 0]


MODEL = ActorCritic()


@functools.partial(jax.jit, static_argnums=2)
def collect(params, key, n_envs):
    """One episode in each of n_envs environments, all at once, sampled from the policy: per step t (arrays [T,
    n_envs]) the observation, action, its log-probability, the state's value, whether the environment was still
    running (the reward: 1 per step survived) and whether the episode ended there; and the values after the last
    step, to bootstrap episodes cut at MAX_STEPS."""
    start_key, key = jax.random.split(key)
    state = jax.random.uniform(start_key, (n_envs, 4), minval=-0.05, maxval=0.05)

    def step(carry, step_key):
        state, running = carry
        logits, value = MODEL.apply({"params": params}, state)
        action = jax.random.categorical(step_key, logits)
        log_prob = jnp.take_along_axis(jax.nn.log_softmax(logits), action[:, None], axis=1)[:, 0]
        new_state, ended = jax.vmap(cartpole_step)(state, action == 1)
        record = dict(obs=state, action=action, log_prob=log_prob, value=value, running=running, ended=ended)
        return (new_state, running & ~ended), record

    (state, _), steps = jax.lax.scan(step, (state, jnp.ones(n_envs, bool)), jax.random.split(key, MAX_STEPS))
    return steps, MODEL.apply({"params": params}, state)[1]


def to_examples(steps, last_value, gamma, lam):
    """GAE(gamma, lambda) advantages and value targets, as one training example per step taken; advantages are
    normalised over the batch."""
    running, ended = steps["running"].astype(np.float32), steps["ended"].astype(np.float32)
    next_value = np.concatenate([steps["value"][1:], last_value[None]])
    advantages, carry = np.zeros_like(running), 0.0
    for t in reversed(range(MAX_STEPS)):  # an ended episode neither bootstraps nor carries advantage back
        delta = running[t] + gamma * next_value[t] * (1 - ended[t]) - steps["value"][t]
        carry = advantages[t] = delta + gamma * lam * (1 - ended[t]) * carry
    taken = steps["running"]
    returns = advantages[taken] + steps["value"][taken]
    normalised = (advantages[taken] - advantages[taken].mean()) / (advantages[taken].std() + 1e-8)
    return [dict(obs=o, action=a, log_prob=p, advantage=g, ret=r) for o, a, p, g, r in zip(
        steps["obs"][taken], steps["action"][taken], steps["log_prob"][taken], normalised, returns)]


def collate_fn(examples):
    return {key: np.stack([e[key] for e in examples]) for key in examples[0]}


def loss_fn(params, batch, rng, is_training, clip=0.2, value_coef=0.5, entropy_coef=0.01):
    """The clipped surrogate, the value error and an entropy bonus (to keep exploring)."""
    logits, value = MODEL.apply({"params": params}, batch["obs"])
    log_probs = jax.nn.log_softmax(logits)
    ratio = jnp.exp(jnp.take_along_axis(log_probs, batch["action"][:, None], axis=1)[:, 0] - batch["log_prob"])
    surrogate = jnp.minimum(ratio * batch["advantage"], jnp.clip(ratio, 1 - clip, 1 + clip) * batch["advantage"])
    entropy = -jnp.sum(jnp.exp(log_probs) * log_probs, axis=-1)
    value_loss = jnp.mean((value - batch["ret"]) ** 2)
    loss = -surrogate.mean() + value_coef * value_loss - entropy_coef * entropy.mean()
    return loss, {"value_loss": value_loss, "clipped": jnp.mean(jnp.abs(ratio - 1) > clip)}


def run(*, mesh=None, n_iterations=15, n_envs=16, epochs_per_iteration=4, per_device_batch_size=8,
        learning_rate=3e-3, gamma=0.99, lam=0.95, seed=0):
    """PPO; returns each iteration's mean episode return (before its update) and the Trainer's step after it."""
    mesh = mesh or engine.make_mesh(data=-1)
    params = MODEL.init(jax.random.key(seed), np.zeros((1, 4), np.float32))["params"]
    trainer = engine.Trainer(mesh=mesh, collate_fn=collate_fn, loss_fn=loss_fn, params=params, seed=seed,
                             optimizer=optax.chain(optax.clip_by_global_norm(0.5), optax.adam(learning_rate)))
    key, returns, steps_after = jax.random.key(seed + 1), [], []
    for _ in range(n_iterations):
        key, episode_key = jax.random.split(key)
        # The policy acts on one device from a host copy of the parameters: they are tiny, and the trainer's
        # copy is replicated over the mesh, where each device would run the same episodes again.
        steps, last_value = jax.device_get(collect(jax.device_get(trainer.params), episode_key, n_envs))
        returns.append(float(steps["running"].sum(0).mean()))
        trainer.fit(to_examples(steps, last_value, gamma, lam), per_device_batch_size=per_device_batch_size,
                    n_epochs=epochs_per_iteration)
        steps_after.append(trainer.step)
    return {"returns": returns, "steps": steps_after, "trainer": trainer}


if __name__ == "__main__":
    from absl import logging
    logging.set_verbosity(logging.WARNING)  # the Trainer's lines at every fit would bury the table
    result = run()
    rows = [f"{i:9d}  {ret:11.1f}  {step:21d}" for i, (ret, step) in enumerate(zip(result["returns"], result["steps"]))]
    print("\n".join(["iteration  mean return  trainer step after it", *rows]))
