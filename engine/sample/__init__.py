"""From logits to tokens and from tokens to text.

Owns: sampling parameters (`sampling_params`), the stateless samplers (`sampler`), grammar and
logit-bias constraints with their llguidance matchers (`structured`), and incremental
detokenization (`detokenizer`). Knows nothing of the scheduler, the KV cache or speculation.
"""
