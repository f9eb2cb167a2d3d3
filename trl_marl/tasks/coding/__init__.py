"""The coding tasks, on HumanEval problems (`humaneval`), with every model-written program run in the sandbox:

- `coop_coding`: the MAGRPO paper's cooperative coding, `helper` writes `aux` and `main` the entry point calling it
  (the `coop_coding` and `coop_coding_multiturn` tasks, the `cooperative_code_reward` reward);
- `code_tester`: the AT-GRPO paper's coder + unit tester (the `code_tester` task and its rewards), whose answers are
  judged in `judging` against deliberately broken variants of the canonical solution from `mutants`;
- `unit_tests`: the `unit_tests` team reward, the team's joined code scored on a dataset's hidden tests.
"""
