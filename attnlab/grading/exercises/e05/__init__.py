"""Exercise 05_quadratic_cost: its parts and what each may not call (its hints: attnlab/course/hints/)."""

from attnlab.grading.exercises import ATTENTION, Part

EXERCISE = "05_quadratic_cost"

# in notebook order: Part(id, title, points, names of the learner's functions the check calls, kind)
PARTS = [
    Part("attention-flops", "counting FLOPs", 1, ("attention_flops",)),
    Part("attention-bytes", "the bytes of each step", 2, ("step_bytes", "attention_bytes")),
    Part("arithmetic-intensity", "arithmetic intensity and the roofline", 2,
         ("arithmetic_intensity", "is_memory_bound")),
    Part("roofline-prediction", "a roofline prediction of the time", 2, ("predict_naive_time",)),
    Part("naive-time-experiment", "predict, then measure, naive attention on this machine", 3,
         ("naive_time_experiment",), "experiment"),
    Part("prediction-explain", "why the prediction misses", 2, (), "manual"),
]

# part id -> patterns of what its answer may not call (besides the library and the references)
FORBIDDEN = {"naive-time-experiment": ATTENTION}
