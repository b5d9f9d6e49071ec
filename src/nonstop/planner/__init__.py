"""The capacity planner (`nonstop simulate`): a cost model of a pipeline, fitted to a run, played
forward to predict throughput, idle time and lag for other pool splits, depths and batches.

- params.py     `PlanParams` (the cost model: pass, step, publish and orchestrator times),
                `Shape` (what the planner may change: engines, ranks, depth, max_lag, batch) and
                `Prediction` (what the model says of a pipeline);
- calibrate.py  `calibrate()`: the costs fitted to one run's span log (nonstop.observe.timeline);
- sharing.py    `Sharing`: processor sharing among a run's actors on one host, its effective cores;
- model.py      `simulate()`: the discrete-event model of a run, returning a `Prediction`;
- trainer_side.py `TrainerSide`: the model's trainer half (batches under max_lag, forwards ahead,
                steps, publish), a mixin of model.py's `Simulation`;
- sweep.py      `sweep()` over config axes and `recommend()`: the best pipeline within a lag bound;
- cli.py        `run_planner()`: the `nonstop simulate` command (calibrate or load, predict, table).
docs/planning.md states the equations.
"""
