"""The DEQ-vs-feed-forward separation study (the second paper, *Separation and Bias of Deep Equilibrium Models on
Expressivity and Learning Dynamics*): its tasks, region counter, Theorem 1/3 checks and analyses, as pure functions
(docs/separation.md). The measurement scripts that use them live in benchmarks/studies/."""
