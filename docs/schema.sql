-- rlproxy's SQLite schema at the newest migration (generated: python -m rlproxy.storage.schema).
-- Do not edit: change rlproxy/storage/models.py, add an Alembic revision, regenerate this file.
-- JSON columns hold JSON text: query them with json_extract(col, '$.path') and json_each(col).
-- Views: messages (one row per chat message of each completion), trajectories (one row per run),
-- validation (mean reward of the validation runs per policy and adapter step).

CREATE TABLE alembic_version (
	version_num VARCHAR(32) NOT NULL,
	CONSTRAINT alembic_version_pkc PRIMARY KEY (version_num)
);

CREATE TABLE completions (
	id INTEGER NOT NULL,
	run_id VARCHAR(128) /* NULL when the request carried no run key */,
	seq INTEGER /* 0,1,2,... order of the call within its run */,
	policy VARCHAR(256) /* policy the request named */,
	adapter VARCHAR(256) /* model the upstream served: base or policy@step */,
	policy_step INTEGER /* 0 = base model */,
	endpoint VARCHAR(64) /* chat.completions or completions */,
	stream BOOLEAN,
	request JSON /* the client's request body, as sent */,
	response JSON /* the response as the client got it (streams assembled) */,
	prompt_token_ids JSON,
	token_ids JSON /* sampled token ids, one list per choice */,
	logprobs JSON /* sampling logprobs, one list per choice */,
	finish_reason VARCHAR(32),
	status VARCHAR(16) /* ok, error, cancelled (client disconnected) */,
	status_code INTEGER,
	error TEXT,
	latency_ms FLOAT,
	ttft_ms FLOAT /* time to first token (streams) */,
	prompt_tokens INTEGER,
	completion_tokens INTEGER,
	created_at DATETIME NOT NULL, capture_id VARCHAR(64) /* unique id the proxy gave the record (its crash-journal replay stores it once) */, response_id VARCHAR(64) /* Responses API: id of the response object; NULL if store: false */, client_request JSON /* Responses API: the request body as the client sent it */, client_response JSON /* Responses API: the response object the client received */, source VARCHAR(16) /* hosted: a text-only upstream answered (token ids NULL: SFT data, never a GRPO sample); NULL: captured with exact tokens */, key_id VARCHAR(32),
	PRIMARY KEY (id),
	FOREIGN KEY(run_id) REFERENCES runs (id) ON DELETE CASCADE,
	CONSTRAINT uq_completions_run_seq UNIQUE (run_id, seq)
);

CREATE TABLE keys (
	id VARCHAR(32) NOT NULL /* public id, key_<hex> */,
	name VARCHAR(128) NOT NULL /* the operator's name for the app */,
	secret_hash VARCHAR(64) NOT NULL /* sha256 hex of the secret (rk-...) */,
	policies JSON /* JSON list of policies it may use; NULL: all */,
	rpm INTEGER /* requests per minute (NULL: no limit) */,
	tpm INTEGER /* tokens per minute (NULL: no limit) */,
	max_streams INTEGER /* streams in flight (NULL: no limit) */,
	scorer_url TEXT /* its own scorer for siblings (NULL: none) */,
	created_at DATETIME NOT NULL,
	revoked_at DATETIME /* NULL: valid */,
	last_used_at DATETIME /* last request seen (updated once a minute at most per replica) */,
	PRIMARY KEY (id),
	UNIQUE (name)
);

CREATE TABLE policies (
	name VARCHAR(256) NOT NULL /* the policy */,
	parent VARCHAR(256) /* policy it was forked from */,
	parent_step INTEGER /* step of parent it was forked from */,
	init_adapter TEXT /* LoRA folder it started from (--init-adapter) */,
	created_at DATETIME NOT NULL,
	PRIMARY KEY (name)
);

CREATE TABLE rollouts (
	id INTEGER NOT NULL,
	policy VARCHAR(256) NOT NULL /* the policy */,
	candidate_step INTEGER NOT NULL /* the new step on trial */,
	incumbent_step INTEGER NOT NULL /* the step it would replace (0 = base) */,
	fraction FLOAT NOT NULL /* share of new runs the candidate serves, 0-1 */,
	status VARCHAR(16) NOT NULL /* canary, promoted or rolled_back */,
	decision VARCHAR(16) /* the last look's outcome: continue, promote or rollback */,
	decided_by VARCHAR(16) /* rule, or manual (rlproxy rollout) */,
	reason TEXT /* why, in words (the test and its numbers) */,
	looks INTEGER DEFAULT '0' NOT NULL /* looks the rule took (each spends alpha / looks) */,
	statistic VARCHAR(16) /* welch_t, paired_t or errors_z */,
	stat_value FLOAT /* the statistic at the last look */,
	p_value FLOAT /* its one-sided p-value */,
	candidate_runs INTEGER /* rewarded runs of the candidate arm */,
	incumbent_runs INTEGER /* rewarded runs of the incumbent arm */,
	candidate_reward FLOAT /* mean reward, candidate arm */,
	incumbent_reward FLOAT /* mean reward, incumbent arm */,
	candidate_error_rate FLOAT /* share of the candidate's runs with a 5xx or a completion cut at its length */,
	incumbent_error_rate FLOAT /* the same, incumbent arm */,
	started_at DATETIME NOT NULL /* runs created from then on are assigned */,
	looked_at DATETIME /* the last look */,
	decided_at DATETIME /* promoted or rolled back at */,
	PRIMARY KEY (id),
	CONSTRAINT uq_rollouts_policy_candidate UNIQUE (policy, candidate_step)
);

CREATE TABLE runs (
	id VARCHAR(128) NOT NULL /* X-Run-Id of the episode */,
	group_id VARCHAR(128) /* X-Group-Id, or a hash of policy+tools+prompt of its first completion */,
	policy VARCHAR(256) /* policy of its first completion */,
	status VARCHAR(16) NOT NULL,
	reward FLOAT,
	metrics JSON /* named numbers posted with the reward */,
	metadata JSON /* free JSON posted with the reward */,
	created_at DATETIME NOT NULL,
	completed_at DATETIME /* when rewarded */,
	trained_step INTEGER /* training_steps.step that used it */, status_reason VARCHAR(32) /* why the trainer set its status: no_sibling, zero_variance, stale, no_usable_completion, nonfinite (see storage/training.py) */, reward_source VARCHAR(16) /* app or judge (NULL reward: waiting for the judge) */, judge_explanation TEXT /* the judge's short reason for its score */, judge_rubric TEXT /* rubric named when the run was completed (NULL: the policy's) */, split VARCHAR(8) DEFAULT 'train' NOT NULL /* train, or val: a validation run, served and stored but never trained */, next_seq INTEGER DEFAULT '0' NOT NULL /* seq the run's next completion gets (the writers' counter, see storage/rows.py) */, segments INTEGER /* rows the trainer merged the run's calls into (1: every call extended the last) */, segment_breaks TEXT /* why the run split: JSON list of {"seq", "reason", "at", "of"} (NULL: no break) */, branch_of INTEGER, key_id VARCHAR(32),
	PRIMARY KEY (id)
);

CREATE TABLE shadow_checks (
	id INTEGER NOT NULL,
	policy VARCHAR(256) NOT NULL,
	candidate_step INTEGER NOT NULL /* the new step */,
	serving_step INTEGER NOT NULL /* the step serving when it ran (0 = base) */,
	status VARCHAR(16) NOT NULL /* running, passed, failed (rolled back) or error */,
	prompts INTEGER /* prompt pairs scored */,
	candidate_score FLOAT /* mean score of the candidate */,
	serving_score FLOAT /* mean score of the serving step */,
	margin FLOAT /* shadow_margin in force */,
	scorer VARCHAR(32),
	pairs JSON /* JSON list of {"completion_id", "candidate", "serving"} scores */,
	reason TEXT /* the decision in words */,
	created_at DATETIME NOT NULL,
	finished_at DATETIME,
	PRIMARY KEY (id),
	CONSTRAINT uq_shadow_checks_candidate UNIQUE (policy, candidate_step)
);

CREATE TABLE sibling_groups (
	id VARCHAR(128) NOT NULL /* the members' runs.group_id */,
	completion_id INTEGER NOT NULL /* the app's call it branched from */,
	run_id VARCHAR(128) /* that call's run (NULL: untagged) */,
	policy VARCHAR(256) NOT NULL /* policy that sampled every member */,
	policy_step INTEGER /* step that sampled them (0 = base) */,
	k INTEGER NOT NULL /* members, the app's answer included when with_original */,
	with_original BOOLEAN NOT NULL /* the app's answer is a member (false: its step was gone, K fresh answers) */,
	reason VARCHAR(16) NOT NULL /* new, alone or plateau (settings.siblings) */,
	temperature FLOAT /* sampling temperature of the siblings */,
	status VARCHAR(16) NOT NULL /* sampling, scoring, scored or failed */,
	scorer VARCHAR(32) /* checks, url or judge (+checks) */,
	attempts INTEGER DEFAULT '0' NOT NULL /* scorer calls made so far */,
	error TEXT /* why it failed (the last scorer error) */,
	sampled_tokens INTEGER /* tokens the siblings sampled */,
	sample_ms FLOAT /* engine wall time of the siblings, ms */,
	created_at DATETIME NOT NULL,
	scored_at DATETIME,
	PRIMARY KEY (id),
	FOREIGN KEY(completion_id) REFERENCES completions (id) ON DELETE CASCADE,
	CONSTRAINT uq_sibling_groups_completion UNIQUE (completion_id)
);

CREATE TABLE training_steps (
	id INTEGER NOT NULL,
	step INTEGER NOT NULL /* 1,2,... per policy; adapter served as policy@step */,
	policy VARCHAR(256) NOT NULL,
	adapter_path TEXT /* checkpoint folder holding the adapter */,
	started_at DATETIME,
	finished_at DATETIME,
	num_groups INTEGER,
	num_runs INTEGER,
	num_tokens INTEGER /* sampled tokens trained on */,
	mean_reward FLOAT,
	loss FLOAT,
	metrics JSON /* loss/, kl/, clip/, reward/, perf/ numbers */,
	config JSON /* resolved trainer settings of this step */, reward_std FLOAT /* std of the step's run rewards */, zero_variance_frac FLOAT /* groups with equal rewards / groups seen since the last step (skipped too) */, kl FLOAT /* per token: k3 to the base when beta > 0, else approx KL to the sampler */, clip_frac_low FLOAT /* fraction of tokens clipped at 1 - epsilon (A < 0) */, clip_frac_high FLOAT /* fraction of tokens clipped at 1 + epsilon_high (A > 0) */, entropy FLOAT /* mean entropy of the policy at the sampled positions, nats */, completion_len_mean FLOAT /* mean sampled tokens per trained completion */, policy_lag_mean FLOAT /* mean adapter steps between sampling and training */, tokens_per_s FLOAT /* prompt + completion tokens trained per second */, grad_norm FLOAT /* global gradient norm before clipping */, kind VARCHAR(16) DEFAULT 'grpo' NOT NULL /* grpo, or sft for supervised steps */, val_reward FLOAT /* mean reward of the val runs served by step - 1 (at the commit) */, val_runs INTEGER /* how many val runs val_reward averages */, positions_merged INTEGER /* token positions the step's forward passes ran (calls merged into segments) */, positions_unmerged INTEGER /* positions one sample per trained call would have run (prompt + completion) */, segment_breaks INTEGER /* calls that did not extend their run's earlier tokens: a new segment each */,
	PRIMARY KEY (id),
	CONSTRAINT uq_training_steps_policy_step UNIQUE (policy, step)
);

CREATE INDEX ix_completions_created_at ON completions (created_at);

CREATE INDEX ix_rollouts_policy_status ON rollouts (policy, status);

CREATE INDEX ix_runs_created_at ON runs (created_at, id);

CREATE INDEX ix_runs_group_id ON runs (group_id);

CREATE INDEX ix_runs_key_id ON runs (key_id);

CREATE INDEX ix_runs_status ON runs (status);

CREATE INDEX ix_runs_status_completed ON runs (status, completed_at, id);

CREATE INDEX ix_runs_status_group ON runs (status, group_id);

CREATE INDEX ix_sibling_groups_status ON sibling_groups (status, created_at);

CREATE UNIQUE INDEX ux_completions_capture_id ON completions (capture_id);

CREATE UNIQUE INDEX ux_completions_response_id ON completions (response_id);

CREATE VIEW messages AS
SELECT c.run_id AS run_id, c.id AS completion_id, c.seq AS seq, CAST(m.key AS INTEGER) AS idx,
       json_extract(m.value, '$.role') AS role,
       json_extract(m.value, '$.content') AS content,
       json_extract(m.value, '$.tool_calls') AS tool_calls,
       json_extract(m.value, '$.name') AS name
FROM completions AS c, json_each(c.request, '$.messages') AS m
WHERE json_type(c.request, '$.messages') = 'array'
UNION ALL
SELECT c.run_id, c.id, c.seq,
       coalesce(json_array_length(c.request, '$.messages'), 0),
       coalesce(json_extract(c.response, '$.choices[0].message.role'), 'assistant'),
       json_extract(c.response, '$.choices[0].message.content'),
       json_extract(c.response, '$.choices[0].message.tool_calls'),
       json_extract(c.response, '$.choices[0].message.name')
FROM completions AS c
WHERE json_type(c.response, '$.choices[0].message') = 'object';

CREATE VIEW rollout_runs AS
SELECT rollout_id, policy,
    CASE WHEN step = candidate_step THEN 'candidate' ELSE 'incumbent' END AS arm,
    step, run_id, group_id, reward, status, errored, created_at, completed_at, key_id
FROM (
    SELECT ro.id AS rollout_id, ro.policy AS policy, ro.candidate_step AS candidate_step,
        ro.incumbent_step AS incumbent_step, r.id AS run_id, r.group_id AS group_id,
        r.reward AS reward, r.status AS status, r.created_at AS created_at,
        r.completed_at AS completed_at, r.key_id AS key_id,
        (SELECT MIN(c.policy_step) FROM completions c WHERE c.run_id = r.id) AS step,
        (SELECT MAX(c.policy_step) FROM completions c WHERE c.run_id = r.id) AS last_step,
        CASE WHEN EXISTS (SELECT 1 FROM completions c WHERE c.run_id = r.id
            AND (c.status_code >= 500 OR c.finish_reason = 'length'
                OR CAST(c.response AS TEXT) LIKE '%<tool_call>%')) THEN 1 ELSE 0 END AS errored
    FROM rollouts ro
    JOIN runs r ON r.policy = ro.policy AND r.created_at >= ro.started_at
        AND (ro.decided_at IS NULL OR r.created_at < ro.decided_at)
        AND r.branch_of IS NULL
        AND NOT EXISTS (SELECT 1 FROM completions c WHERE c.run_id = r.id AND json_extract(c.request, '$.model') LIKE '%@%')
) AS a
WHERE step = last_step AND step IN (candidate_step, incumbent_step);

CREATE VIEW trajectories AS
SELECT r.id AS run_id, r.group_id AS group_id, r.reward AS reward, r.status AS status,
       (SELECT count(*) FROM completions AS c WHERE c.run_id = r.id) AS n_completions,
       (SELECT CASE
                 WHEN json_type(c.response, '$.choices[0].message') = 'object'
                 THEN json_insert(coalesce(json_extract(c.request, '$.messages'), '[]'), '$[#]',
                                  json(json_extract(c.response, '$.choices[0].message')))
                 ELSE coalesce(json_extract(c.request, '$.messages'), '[]')
               END
        FROM completions AS c WHERE c.run_id = r.id ORDER BY c.seq DESC LIMIT 1) AS messages
FROM runs AS r;

CREATE VIEW untagged AS
SELECT c.id AS completion_id,
       coalesce(c.response_id, json_extract(c.client_response, '$.id'), json_extract(c.response, '$.id'))
         AS reply_id,
       c.created_at AS created_at, c.policy AS policy, c.policy_step AS policy_step,
       c.endpoint AS endpoint, c.status AS status, c.status_code AS status_code,
       c.finish_reason AS finish_reason, c.prompt_tokens AS prompt_tokens,
       c.completion_tokens AS completion_tokens, c.latency_ms AS latency_ms
FROM completions AS c
WHERE c.run_id IS NULL;

CREATE VIEW validation AS
SELECT policy, step, COUNT(*) AS val_runs, AVG(reward) AS val_reward
FROM (
    SELECT r.policy AS policy, r.reward AS reward,
        (SELECT MIN(c.policy_step) FROM completions c WHERE c.run_id = r.id) AS step,
        (SELECT MAX(c.policy_step) FROM completions c WHERE c.run_id = r.id) AS last_step
    FROM runs r
    WHERE r.status = 'validated' AND r.reward IS NOT NULL AND r.policy IS NOT NULL
) AS v
WHERE step IS NOT NULL AND step = last_step
GROUP BY policy, step;
