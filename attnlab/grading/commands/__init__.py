"""The grader's commands: ``attnlab grade`` and ``attnlab progress``, and nbgrader's and Gradescope's ends of
``attnlab grade`` (:mod:`attnlab.grading.commands.nbgrader`). The course's own (``generate``, ``start``) are in
:mod:`attnlab.course`."""
