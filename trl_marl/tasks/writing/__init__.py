"""The MAGRPO paper's writing-collaboration tasks (arXiv 2508.04652), each written by a pair of agents at once:
`summaries` and `expansion` with their data (`summaries_expansion`), and their team rewards `summary_reward` and
`expansion_reward` (`rewards`), four gated levels scored by the pure functions of `levels`."""
