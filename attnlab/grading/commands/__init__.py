"""The commands: ``attnlab generate`` (instructors), ``attnlab grade``, ``attnlab start`` and ``attnlab progress``,
and nbgrader's and Gradescope's ends of ``attnlab grade`` (:mod:`attnlab.grading.commands.nbgrader`)."""
