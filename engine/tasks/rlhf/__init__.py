"""RLHF on the Trainer: prompt/response and preference rows with DPO (`preference`), reward-model training and
scoring (`reward`; the model itself is `models.RewardModel`), and PPO / GRPO (`ppo`)."""
