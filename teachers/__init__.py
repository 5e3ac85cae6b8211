"""Teacher backends (transformers local, vLLM in-process, vLLM server), per-task teacher specs
(`teachers/<task>/teacher.yaml`), the tokenizer guard, and trajectory scoring routed by env name.

    spec = load_teacher_spec("teachers/alfworld/teacher.yaml")
    teacher = make_teacher(spec)
    check_tokenizers(student_tokenizer, teacher.tokenizer, "student", spec.name)
    score_trajectories({"alfworld": teacher}, trajectories, topk=0)
"""

from teachers import transformers_teacher, vllm_server, vllm_teacher  # noqa: F401  (register backends)
from teachers.base import (
    TEACHER_BACKENDS,
    Teacher,
    TokenizerMismatchError,
    TokenScores,
    check_tokenizers,
)
from teachers.scoring import score_trajectories
from teachers.spec import (
    TeacherSpec,
    TeacherSpecError,
    load_teacher_spec,
    make_teacher,
    make_teachers,
    save_teacher_spec,
    server_command,
)
from teachers.vllm_server import TeacherServerError, merge_replica_stats, replica_stats

__all__ = [
    "TEACHER_BACKENDS", "Teacher", "TeacherServerError", "TeacherSpec", "TeacherSpecError", "TokenScores",
    "TokenizerMismatchError", "check_tokenizers", "load_teacher_spec", "make_teacher", "make_teachers",
    "merge_replica_stats", "replica_stats", "save_teacher_spec", "score_trajectories", "server_command",
]
