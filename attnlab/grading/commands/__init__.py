"""The grader's command, ``attnlab grade``, and nbgrader's and Gradescope's ends of it
(:mod:`attnlab.grading.commands.nbgrader`). The course's own commands (``generate``, ``start``, ``progress``,
which grades a learner's working folder with ``attnlab grade``) are in :mod:`attnlab.course`."""
