"""The RL maths as pure torch functions (token logprobs, advantages, the decoupled PPO loss) and the
configs that select and parametrise them."""
