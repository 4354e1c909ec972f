"""Whether the profile tells the truth: the readers read the stacks Python reads (section
`oracle`), shares are unbiased when work alternates near the sampling interval (`bias`, its
runs in bias_child.py), task-tagged samples go to the right task (`attribution`), a diff puts
a slowed function's gain where it is (`diff`), and an idle cluster's loops are not counted as
running (`idle`). Each section is the module of its name."""
