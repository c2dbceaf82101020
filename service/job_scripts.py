"""The job store's Lua scripts: each moves an item (or a delivery) from one state to the next in one atomic step,
so that a worker that dies between two commands leaves no job half-counted."""

# Scripts that let work finish run even when Redis is at its maxmemory (Redis 7 script flags): finishing an item
# frees its upload, so refusing them would hold a full Redis full until its jobs expired.
_ALLOW_OOM = "#!lua flags=allow-oom\n"

# Keys written after submission (attempts, errors, results) expire with the job: an EXPIRE at submission does
# nothing to a key that does not exist yet, and a job that never finished would leave them behind for ever.
_EXPIRE_WITH_JOB = """
local function expire_with_job(job_key, key)
  local ttl = redis.call('PTTL', job_key)
  if ttl > 0 then redis.call('PEXPIRE', key, ttl) end
end
"""

# KEYS: job, states, attempts, inputs, upload. ARGV: index, now, the largest upload returned whole.
# Returns {state, attempts[, cancels, input JSON, upload size[, upload]]}: the caller processes the item only if
# state is "in_progress", and then gets the job's cancels so far (a later one is what stops the item: see
# REQUEST_CANCEL) and its input in the same round trip (a missing one comes back as nil, a missing upload as size
# -1), and a small upload with it (a larger one it reads a piece at a time: service.job_uploads). "cancelling"
# (with the input): the job was cancelled since the item was queued (a worker read it ahead, or it was queued on a
# page the cancel had not reached): the caller finishes it as cancelled.
START_ITEM = _ALLOW_OOM + _EXPIRE_WITH_JOB + """
local state = redis.call('HGET', KEYS[2], ARGV[1])
if state == false then return {'missing', 0} end
if state == 'completed' or state == 'failed' or state == 'cancelled' then return {state, 0} end
local cancels = tonumber(redis.call('HGET', KEYS[1], 'cancels') or '0')
local requested = tonumber(redis.call('HGET', KEYS[1], 'cancel_requested') or '0')
if requested > tonumber(redis.call('HGET', KEYS[1], 'cancel_set_aside') or '0') then  -- not retried since
  return {'cancelling', 0, cancels, redis.call('HGET', KEYS[4], ARGV[1]), -1}
end
local attempts = redis.call('HINCRBY', KEYS[3], ARGV[1], 1)
expire_with_job(KEYS[1], KEYS[3])
if state == 'queued' then
  redis.call('HSET', KEYS[2], ARGV[1], 'in_progress')
  redis.call('HINCRBY', KEYS[1], 'n_queued', -1)
  redis.call('HINCRBY', KEYS[1], 'n_in_progress', 1)
  if redis.call('HGET', KEYS[1], 'status') == 'queued' then
    redis.call('HSET', KEYS[1], 'status', 'in_progress', 'started_at', ARGV[2])
  end
end
local input = redis.call('HGET', KEYS[4], ARGV[1])
if redis.call('EXISTS', KEYS[5]) == 0 then return {'in_progress', attempts, cancels, input, -1} end
local size = redis.call('STRLEN', KEYS[5])
if size > tonumber(ARGV[3]) then return {'in_progress', attempts, cancels, input, size} end
return {'in_progress', attempts, cancels, input, size, redis.call('GET', KEYS[5])}
"""

# KEYS: job. A cancel, remembered on a job still queued or in progress (not on one gone: a purge or its
# TTL between the caller's read and this left a record of this field alone, never to expire): its number among the
# job's cancels ('cancels'), in 'cancel_requested'. A consumer stops the items it holds that were started before
# this cancel, not those of a retry since; a retry of the failed items sets the cancels so far aside for the items
# it queues ('cancel_set_aside': START_ITEM starts them), and leaves the number for the items started before them.
# Returns that number, or 0.
# allow-oom: a full Redis is when an operator cancels.
REQUEST_CANCEL = _ALLOW_OOM + """
local status = redis.call('HGET', KEYS[1], 'status')
if status ~= 'queued' and status ~= 'in_progress' then return 0 end
local cancels = redis.call('HINCRBY', KEYS[1], 'cancels', 1)
redis.call('HSET', KEYS[1], 'cancel_requested', cancels)
return cancels
"""

# The end of a job, shared by the scripts that finish items: once every item is finished, the job's status
# and finish time; a job with a webhook also queues its delivery here, so no crash can end it without one.
# Returns 1 (items left) or 2 (the job ended now).
_END_JOB_IF_DONE = """
local function end_job_if_done(job_key, webhook_stream, now, job_id)
  local job = redis.call('HMGET', job_key, 'total', 'n_completed', 'n_failed', 'n_cancelled')
  local total, completed, failed, cancelled = tonumber(job[1]), tonumber(job[2]), tonumber(job[3]), tonumber(job[4])
  if completed + failed + cancelled < total then return 1 end
  local status = 'completed'
  if cancelled > 0 then status = 'cancelled'
  elseif failed == total then status = 'failed'
  elseif failed > 0 then status = 'completed_with_errors' end
  redis.call('HSET', job_key, 'status', status, 'finished_at', now)
  local ends = redis.call('HINCRBY', job_key, 'ends', 1)  -- a retry of its failed items ends it again
  local hook = redis.call('HGET', job_key, 'webhook_url')
  if hook and hook ~= '' then redis.call('XADD', webhook_stream, '*', 'job', job_id, 'end', ends) end
  return 2
end
"""

# KEYS: job, states, results, errors, webhook stream, upload, dead-letter stream. ARGV: index, final state, result
# JSON, error, now, audio_s, compute_s, job id, scored tokens, the sum of their log-probabilities, dead letters kept.
# Writes the result only if none exists, and only while the job does (not once it has expired or been deleted);
# drops the item's uploaded audio; dead-letters a failed item in the same step. Returns 0 (already finished, or no
# job), 1 (finished), 2 (finished the job).
FINISH_ITEM = _ALLOW_OOM + _END_JOB_IF_DONE + _EXPIRE_WITH_JOB + """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
if redis.call('HSETNX', KEYS[3], ARGV[1], ARGV[3]) == 0 then return 0 end
expire_with_job(KEYS[1], KEYS[3])
redis.call('DEL', KEYS[6])
if ARGV[2] == 'failed' then
  redis.call('XADD', KEYS[7], 'MAXLEN', '~', ARGV[11], '*', 'job', ARGV[8], 'index', ARGV[1], 'error', ARGV[4],
             'at', ARGV[5])
end
local previous = redis.call('HGET', KEYS[2], ARGV[1])
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
redis.call('HINCRBY', KEYS[1], 'n_' .. previous, -1)
redis.call('HINCRBY', KEYS[1], 'n_' .. ARGV[2], 1)
if ARGV[4] ~= '' then
  redis.call('HSET', KEYS[4], ARGV[1], ARGV[4])
  expire_with_job(KEYS[1], KEYS[4])
end
redis.call('HINCRBYFLOAT', KEYS[1], 'audio_s', ARGV[6])
redis.call('HINCRBYFLOAT', KEYS[1], 'compute_s', ARGV[7])
if tonumber(ARGV[9]) > 0 then
  redis.call('HINCRBY', KEYS[1], 'tokens', ARGV[9])
  redis.call('HINCRBYFLOAT', KEYS[1], 'logprob_sum', ARGV[10])
end
return end_job_if_done(KEYS[1], KEYS[5], ARGV[5], ARGV[8])
"""

# KEYS: job, states, results, inputs, webhook stream. ARGV: now, job id, then item indices. Cancels those still
# queued (a result record each: ARGV[3], item_record's for a cancelled item, with its audio set); returns 0 (none),
# 1 (some) or 2 (and the job ended).
CANCEL_QUEUED = _ALLOW_OOM + _END_JOB_IF_DONE + _EXPIRE_WITH_JOB + """
local n = 0
local record = cjson.decode(ARGV[3])
for i = 4, #ARGV do
  local index = ARGV[i]
  if redis.call('HGET', KEYS[2], index) == 'queued' then
    local input = redis.call('HGET', KEYS[4], index)
    record['audio'] = cjson.null
    if input then record['audio'] = cjson.decode(input)['audio'] end
    if redis.call('HSETNX', KEYS[3], index, cjson.encode(record)) == 1 then
      redis.call('HSET', KEYS[2], index, 'cancelled')
      n = n + 1
    end
  end
end
if n == 0 then return 0 end
expire_with_job(KEYS[1], KEYS[3])
redis.call('HINCRBY', KEYS[1], 'n_queued', -n)
redis.call('HINCRBY', KEYS[1], 'n_cancelled', n)
return end_job_if_done(KEYS[1], KEYS[5], ARGV[1], ARGV[2])
"""

# KEYS: job, webhook stream. ARGV: group, the delivery's entry, the end of the job the webhook announced (its
# 'ends' then; 0: a delivery queued before ends were counted), then field, value, ... How a delivery went, written
# only while the job is still at that end: not once it has expired (a late write would leave a hash behind with no
# TTL), nor once a retry has made it owe another (a first end's delivery finishing after the retry would mark the
# next one done before it was sent); and the delivery acknowledged, whatever was written. allow-oom, in a script of
# its own rather than a MULTI (whose commands Redis refuses at maxmemory): a refused record left the delivery
# pending, and it was posted again at each reclaim.
RECORD_WEBHOOK = _ALLOW_OOM + """
local recorded = 0
if redis.call('EXISTS', KEYS[1]) == 1 then
  local job = redis.call('HMGET', KEYS[1], 'ends', 'finished_at')
  if ARGV[3] == '0' or (job[1] == ARGV[3] and job[2]) then
    redis.call('HSET', KEYS[1], unpack(ARGV, 4))
    recorded = 1
  end
end
redis.call('XACK', KEYS[2], ARGV[1], ARGV[2])
return recorded
"""

# KEYS: job, webhook stream, retries (sorted set). ARGV: group, the delivery's entry, the end it announces (as
# RECORD_WEBHOOK), its next attempt, when that is due (ms), the retry's record (JSON), the last error. A delivery
# whose attempt failed and that is tried again later: out of the stream (a slot is not held through the pause) and
# into the retries, in one step, with what the job shows meanwhile (still pending) if it is still at that end.
DEFER_WEBHOOK = _ALLOW_OOM + """
if redis.call('EXISTS', KEYS[1]) == 1 then
  local job = redis.call('HMGET', KEYS[1], 'ends', 'finished_at')
  if ARGV[3] == '0' or (job[1] == ARGV[3] and job[2]) then
    redis.call('HSET', KEYS[1], 'webhook_attempts', tonumber(ARGV[4]) - 1, 'webhook_error', ARGV[7])
  end
end
redis.call('ZADD', KEYS[3], ARGV[5], ARGV[6])
redis.call('XACK', KEYS[2], ARGV[1], ARGV[2])
return 1
"""

# KEYS: retries (sorted set), webhook stream. ARGV: now (ms), at most how many. The retries due, back on the stream
# (job, end, attempt) for any worker; returns how many, and how many wait still.
PROMOTE_WEBHOOKS = _ALLOW_OOM + """
local due = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1], 'LIMIT', 0, tonumber(ARGV[2]))
for _, record in ipairs(due) do
  local retry = cjson.decode(record)
  redis.call('XADD', KEYS[2], '*', 'job', retry.job, 'end', retry['end'], 'attempt', retry.attempt)
  redis.call('ZREM', KEYS[1], record)
end
return {#due, redis.call('ZCARD', KEYS[1])}
"""

# KEYS: job, errors. ARGV: index, error. An item's last error, kept while the job is, and as long.
RECORD_ERROR = _EXPIRE_WITH_JOB + """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
expire_with_job(KEYS[1], KEYS[2])
return 1
"""

# KEYS: stream. ARGV: group, consumer, then message ids. Renews the deliveries still the consumer's: one another
# consumer has reclaimed (this one was stopped, or cut off, past the visibility timeout) stays with that one.
KEEP_CLAIMED = _ALLOW_OOM + """
local kept = 0
for i = 3, #ARGV do
  if #redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1, ARGV[2]) == 1 then
    redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[i], 'JUSTID')
    kept = kept + 1
  end
end
return kept
"""

# Pending deliveries, listed by the script that calls this, claimed by a consumer (their idle time starts again): the
# entries claimed. Entries trimmed away while pending are acknowledged (Redis 6.2 answers them as nil; 7.0 leaves them
# out, and off the pending list).
_CLAIM = """
local function claim(stream, group, consumer, ids)
  local claimed, entries = {}, {}
  for _, entry in ipairs(redis.call('XCLAIM', stream, group, consumer, 0, unpack(ids))) do
    if entry and entry[2] then
      claimed[entry[1]] = true
      table.insert(entries, entry)
    end
  end
  for _, id in ipairs(ids) do
    if not claimed[id] then
      redis.call('XACK', stream, group, id)
    end
  end
  return entries
end
"""

# KEYS: an item stream (or the webhook stream). ARGV: the group, a consumer, how many at most, then the ids the
# consumer holds. Up to that many deliveries to the consumer that it does not hold, claimed by it again, in one step:
# none can be claimed by another meanwhile. Returns {how many were found, the entries}.
CLAIM_OWN_LEFT = _ALLOW_OOM + _CLAIM + """
local count = tonumber(ARGV[3])
local held = {}
for i = 4, #ARGV do
  held[ARGV[i]] = true
end
local ids = {}
for _, entry in ipairs(redis.call('XPENDING', KEYS[1], ARGV[1], '-', '+', count + #ARGV - 3, ARGV[2])) do
  if not held[entry[1]] and #ids < count then
    table.insert(ids, entry[1])
  end
end
if #ids == 0 then
  return {0, {}}
end
return {#ids, claim(KEYS[1], ARGV[1], ARGV[2], ids)}
"""

# KEYS: a consumer name's key (CONSUMER_NAME_KEY). ARGV: this instance's id, the lease in ms. 1: the name is this
# instance's for the lease (taken, or renewed); 0: another instance running under it holds it.
HOLD_NAME = _ALLOW_OOM + """
local holder = redis.call('GET', KEYS[1])
if holder and holder ~= ARGV[1] then
  return 0
end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return 1
"""

# KEYS: a consumer name's key. ARGV: this instance's id. The name let go, if this instance holds it.
RELEASE_NAME = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('DEL', KEYS[1])
end
return 0
"""

# KEYS: a job's uploads, written already (service.job_uploads). ARGV: seconds. Their input TTL, given in the job's
# transaction: one command for all of them, not one each (a job of 100,000 small files spent 1.7 s on those).
EXPIRE_ALL = """
for _, key in ipairs(KEYS) do redis.call('EXPIRE', key, ARGV[1]) end
return #KEYS
"""

# KEYS: the job's owner's list, then keys of the job to delete (its records, or a page of its uploads). ARGV: job id.
# A purge, in steps of one page: allow-oom, since a full Redis is when an operator purges (a transaction's DELs are
# refused there, as every command queued in a MULTI is).
PURGE_JOB = _ALLOW_OOM + """
redis.call('ZREM', KEYS[1], ARGV[1])
for i = 2, #KEYS do redis.call('DEL', KEYS[i]) end
return #KEYS - 1
"""

# KEYS: a job's records (JOB_KEYS, the job first). ARGV: the result TTL in seconds. Given to a job that has ended,
# unless a retry of its failed items has begun it again since (the end's caller sets it after the end's step: a
# retry between them kept a new job's time, and this cut it to the results' time). Returns 1 if given.
EXPIRE_FINISHED = _ALLOW_OOM + """
local status = redis.call('HGET', KEYS[1], 'status')
if not status or status == 'queued' or status == 'in_progress' then return 0 end
for _, key in ipairs(KEYS) do redis.call('EXPIRE', key, ARGV[1]) end
return 1
"""

# KEYS: an owner's list of jobs (scored by creation). ARGV: the score at or before which a job has had a new job's
# time, the job key's prefix. Those jobs' ids are dropped, but for jobs still there: retried, a job's records are
# kept a new job's time from the retry, and it is listed as long as it can be read.
PRUNE_OWNER_JOBS = """
local dropped = 0
for _, id in ipairs(redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1])) do
  if redis.call('EXISTS', ARGV[2] .. id) == 0 then
    redis.call('ZREM', KEYS[1], id)
    dropped = dropped + 1
  end
end
return dropped
"""

# KEYS: the replication mark. The write that WAIT confirms replicas hold (JobStore._confirm_replicated): allow-oom, as
# what it confirms may be a cancel or a purge, which a full Redis takes.
MARK_REPLICATION = _ALLOW_OOM + """
return redis.call('INCR', KEYS[1])
"""

# XINFO's replies (a flat list of names and values each) as tables, name -> value. Parsed here: in the client, a
# worker with a few hundred streams (API keys') spent most of a read parsing XINFO's replies.
_XINFO = """
local function xinfo(...)
  local described = {}
  for _, flat in ipairs(redis.call('XINFO', ...)) do
    local fields = {}
    for i = 1, #flat, 2 do fields[flat[i]] = flat[i + 1] end
    table.insert(described, fields)
  end
  return described
end
"""

# A group on a stream as XINFO GROUPS describes it, or nil: no such group (existing_group: on a stream known to
# exist, since XINFO errs on one that does not), or no such stream either (group_fields).
_GROUP_FIELDS = _XINFO + """
local function existing_group(stream, group)
  for _, fields in ipairs(xinfo('GROUPS', stream)) do
    if fields['name'] == group then return fields end
  end
  return nil
end
local function group_fields(stream, group)
  if redis.call('EXISTS', stream) == 0 then return nil end
  return existing_group(stream, group)
end
"""

# A stream's two counts in a group: the entries not yet delivered to the group (its lag; -1 where Redis cannot
# count them, or the stream has no such group) and those delivered and not acknowledged; -2, 0 for a stream that
# does not exist.
_GROUP_COUNTS = _GROUP_FIELDS + """
local function group_counts(stream, group)
  if redis.call('EXISTS', stream) == 0 then return -2, 0 end
  local fields = existing_group(stream, group)
  if not fields then return -1, 0 end
  return fields['lag'] or -1, fields['pending']
end
"""

# KEYS: streams. ARGV: group. Each stream's two counts (above), in one round trip.
GROUP_COUNTS = _GROUP_COUNTS + """
local counts = {}
for _, stream in ipairs(KEYS) do
  local lag, pending = group_counts(stream, ARGV[1])
  table.insert(counts, lag)
  table.insert(counts, pending)
end
return counts
"""

# KEYS: streams. ARGV: group. Each stream's entries before the oldest one the group has not acknowledged are
# dropped (all acknowledged: those up to the last one delivered, since what comes after it is not delivered yet);
# streams without the group are left alone. One round trip however many streams (API keys') there are, and nothing
# acknowledged between the look and the trim. Returns the entries dropped.
TRIM_ACKNOWLEDGED = _ALLOW_OOM + _GROUP_FIELDS + """
local dropped = 0
for _, stream in ipairs(KEYS) do
  local fields = group_fields(stream, ARGV[1])
  if fields then
    local keep_from = fields['last-delivered-id']
    if tonumber(fields['pending']) > 0 then keep_from = redis.call('XPENDING', stream, ARGV[1])[2] end
    dropped = dropped + redis.call('XTRIM', stream, 'MINID', keep_from)
  end
end
return dropped
"""

# KEYS: streams. ARGV: group, idle ms. The group's consumers that hold no delivery and have been idle that long
# are deleted (the names of workers gone: a restarted worker joins under a new name). Looked at and deleted in one
# step, so none can take a delivery in between, which DELCONSUMER would drop with it. Returns how many.
FORGET_CONSUMERS = _GROUP_FIELDS + """
local forgotten = 0
for _, stream in ipairs(KEYS) do
  if group_fields(stream, ARGV[1]) then
    for _, consumer in ipairs(xinfo('CONSUMERS', stream, ARGV[1])) do
      if consumer['pending'] == 0 and consumer['idle'] >= tonumber(ARGV[2]) then
        redis.call('XGROUP', 'DELCONSUMER', stream, ARGV[1], consumer['name'])
        forgotten = forgotten + 1
      end
    end
  end
end
return forgotten
"""

# KEYS: streams. ARGV: group, a consumer, how many at most, idle ms, CONSUMER_NAME_KEY's text before the name.
# Up to that many deliveries, over the streams in turn, to consumers that are gone: their name held by no running
# instance (its lease lapsed with the worker killed, or let go as it stopped), idle that long, each delivery idle
# that long too; claimed by the consumer in one step, so that none is claimed twice, nor from a consumer that came
# back meanwhile. (Name keys are read by their names' text: the names are known only here.) Returns {stream, claimed
# entries, the gone consumers' names} for each stream where some were claimed.
CLAIM_FROM_GONE = _ALLOW_OOM + _GROUP_FIELDS + _CLAIM + """
local left, idle = tonumber(ARGV[3]), tonumber(ARGV[4])
local claimed = {}
for _, stream in ipairs(KEYS) do
  if left > 0 and group_fields(stream, ARGV[1]) then
    local entries, names = {}, {}
    for _, consumer in ipairs(xinfo('CONSUMERS', stream, ARGV[1])) do
      local name = consumer['name']
      if left > 0 and consumer['pending'] > 0 and consumer['idle'] >= idle and name ~= ARGV[2]
          and redis.call('EXISTS', ARGV[5] .. name) == 0 then
        local ids = {}
        for _, entry in ipairs(redis.call('XPENDING', stream, ARGV[1], 'IDLE', idle, '-', '+', left, name)) do
          table.insert(ids, entry[1])
        end
        if #ids > 0 then
          for _, entry in ipairs(claim(stream, ARGV[1], ARGV[2], ids)) do
            table.insert(entries, entry)
          end
          left = left - #ids
          table.insert(names, name)
        end
      end
    end
    if #names > 0 then table.insert(claimed, {stream, entries, names}) end
  end
end
return claimed
"""

# Redis's clock in ms (TIME: seconds, microseconds), for the times the owners' streams were used and retired.
_NOW_MS = """
local function now_ms()
  local time = redis.call('TIME')
  return time[1] * 1000 + math.floor(time[2] / 1000)
end
"""

# An owner's items queued or in progress (lag, where known, and pending over its streams) and those reserved by
# jobs being queued, in one count: its reservations' hash (RESERVED_KEY), its item streams (a table), the workers'
# group, how long a reservation holds (ms), and whether to drop a reservation older than that (its submitter died
# between it and its job's transaction) or just leave it out (a script that only reads).
_OWNER_ITEMS = _NOW_MS + _GROUP_COUNTS + """
local function owner_items(reserved, streams, group, hold_ms, drop_lapsed)
  local now, counted = now_ms(), 0
  local held = redis.call('HGETALL', reserved)
  for i = 1, #held, 2 do
    local items, at = string.match(held[i + 1], '^(%d+):(%d+)$')
    if now - tonumber(at) < tonumber(hold_ms) then
      counted = counted + tonumber(items)
    elseif drop_lapsed then
      redis.call('HDEL', reserved, held[i])
    end
  end
  for _, stream in ipairs(streams) do
    local lag, pending = group_counts(stream, group)
    counted = counted + math.max(lag, 0) + pending
  end
  return counted
end
"""

# KEYS: the owner's reservations, then its item streams. ARGV: group, how long a reservation holds (ms). The
# owner's items as its limit counts them (above); reads only, so a replica answers it too.
OWNER_ITEMS = "#!lua flags=no-writes\n" + _OWNER_ITEMS + """
return owner_items(KEYS[1], {unpack(KEYS, 2)}, ARGV[1], ARGV[2], false)
"""

# KEYS: the owner's reservations (RESERVED_KEY), then its item streams. ARGV: group, job id, items, the limit, how
# long a reservation holds (ms). The owner's items (above) counted in one step with the job's own reservation: two
# submissions at once cannot both pass the limit, and neither holds the other up (the items are queued in a
# transaction of their own, which drops the reservation). Returns {1 reserved | 0 refused, the items counted}.
RESERVE_ITEMS = "#!lua\n" + _OWNER_ITEMS + """
local counted = owner_items(KEYS[1], {unpack(KEYS, 2)}, ARGV[1], ARGV[5], true)
if counted + tonumber(ARGV[3]) > tonumber(ARGV[4]) then return {0, counted} end
redis.call('HSET', KEYS[1], ARGV[2], ARGV[3] .. ':' .. now_ms())
redis.call('PEXPIRE', KEYS[1], ARGV[5])
return {1, counted}
"""

# KEYS: job, states, results, errors, attempts, inputs (all of the job's records: given the TTL a new job's have),
# the job's item stream, then, with a queued-items limit, the owner's reservations and item streams. ARGV: job id,
# that TTL in ms, the limit ('': none), the workers' group, how long a reservation holds (ms), then item indices.
# Queues those that failed again, from a first attempt, but for uploads (their audio went with their result), and
# only as many as the owner's limit has room for (counted as a submission's reservation is, in the same step): the
# others stay failed, for a later retry. The job is in progress until those queued finish, and its webhook, if it
# has one, is owed again. New work, which a full Redis refuses as it does a submission: its flags declared (none,
# so not allow-oom), Redis 7 checks memory before the script runs, not at a write part way through. Returns {items
# queued again, failed uploads left as they were, items the limit left failed, the owner's items counted}.
RETRY_FAILED = "#!lua\n" + _OWNER_ITEMS + """
if redis.call('EXISTS', KEYS[1]) == 0 then return {0, 0, 0, 0} end
local counted, room = 0, math.huge
if ARGV[3] ~= '' then
  counted = owner_items(KEYS[8], {unpack(KEYS, 9)}, ARGV[4], ARGV[5], true)
  room = tonumber(ARGV[3]) - counted
end
local queued, kept, deferred = 0, 0, 0
for i = 6, #ARGV do
  local index = ARGV[i]
  if redis.call('HGET', KEYS[2], index) == 'failed' then
    local input = redis.call('HGET', KEYS[6], index)
    local readable, record = pcall(cjson.decode, input or '')
    if not readable or type(record) ~= 'table' or record['upload'] then  -- an upload, or no input to queue
      kept = kept + 1
    elseif queued >= room then
      deferred = deferred + 1
    else
      redis.call('HSET', KEYS[2], index, 'queued')
      redis.call('HDEL', KEYS[3], index)
      redis.call('HDEL', KEYS[4], index)
      redis.call('HDEL', KEYS[5], index)
      redis.call('XADD', KEYS[7], '*', 'job', ARGV[1], 'index', index)
      queued = queued + 1
    end
  end
end
if queued == 0 then return {0, kept, deferred, counted} end
-- a cancelled job's failed items, retried, are wanted again; those held since before the cancel are not (their
-- consumers read 'cancel_requested' to stop them, and may not have looked yet)
redis.call('HSET', KEYS[1], 'cancel_set_aside', redis.call('HGET', KEYS[1], 'cancels') or '0')
redis.call('HINCRBY', KEYS[1], 'n_failed', -queued)
redis.call('HINCRBY', KEYS[1], 'n_queued', queued)
redis.call('HSET', KEYS[1], 'status', 'in_progress')
redis.call('HDEL', KEYS[1], 'finished_at')
local hook = redis.call('HGET', KEYS[1], 'webhook_url')
if hook and hook ~= '' then
  redis.call('HSET', KEYS[1], 'webhook_status', 'pending', 'webhook_attempts', 0, 'webhook_error', '')
end
for i = 1, 6 do redis.call('PEXPIRE', KEYS[i], ARGV[2]) end
return {queued, kept, deferred, counted}
"""

# KEYS: an item stream, the owners' streams listed (stream -> priority), when each was last given items, then the
# streams every worker reads (the priorities' own, the webhooks'). ARGV: group, the stream's priority ('' for a
# priority's own stream, the anonymous owner's, which is never listed). Run in the transaction that queues items on
# the stream, before them: the group made on each stream not there (never made, or deleted as idle by
# PRUNE_STREAMS: the workers' blocking read waits on the shared ones), and an owner's stream listed for the workers,
# so that no item can be queued on a stream that is going, or on one the workers do not read.
OPEN_STREAM = _NOW_MS + """
for i, stream in ipairs(KEYS) do
  if i ~= 2 and i ~= 3 and redis.call('EXISTS', stream) == 0 then
    redis.call('XGROUP', 'CREATE', stream, ARGV[1], '0', 'MKSTREAM')
  end
end
if ARGV[2] ~= '' then
  redis.call('HSET', KEYS[2], KEYS[1], ARGV[2])
  redis.call('HSET', KEYS[3], KEYS[1], now_ms())
end
return 1
"""

# KEYS: the owners' streams listed (stream -> priority), when each was last given items, those retired (stream ->
# "ms:priority"). ARGV: group, idle ms, grace ms. An owner's stream given no items for the idle time, its entries
# all delivered and acknowledged, is unlisted (retired): workers stop reading it at their next read. A grace later,
# when no read can have it in hand any more, it is deleted, unless it was listed again meanwhile (OPEN_STREAM, with
# new items). So an API key's streams last only while the key is in use: each costs every worker's read a look.
# Returns {retired, deleted}.
PRUNE_STREAMS = _NOW_MS + _GROUP_COUNTS + """
local now = now_ms()
local function settled(stream)
  local lag, pending = group_counts(stream, ARGV[1])
  return lag == -2 or (lag == 0 and pending == 0)
end
local retired, deleted = 0, 0
local gone = redis.call('HGETALL', KEYS[3])
for i = 1, #gone, 2 do
  local stream = gone[i]
  local at, priority = string.match(gone[i + 1], '^(%d+):(.*)$')
  if redis.call('HEXISTS', KEYS[1], stream) == 1 then
    redis.call('HDEL', KEYS[3], stream)  -- in use again
  elseif now - tonumber(at) >= tonumber(ARGV[3]) then
    redis.call('HDEL', KEYS[3], stream)
    if settled(stream) then
      redis.call('DEL', stream)
      redis.call('HDEL', KEYS[2], stream)
      deleted = deleted + 1
    else  -- given items while unlisted, which OPEN_STREAM does not allow: listed again, so that they are read
      redis.call('HSET', KEYS[1], stream, priority)
    end
  end
end
local listed = redis.call('HGETALL', KEYS[1])
for i = 1, #listed, 2 do
  local stream = listed[i]
  local used = tonumber(redis.call('HGET', KEYS[2], stream))  -- none: listed by a version before this one
  if used and now - used >= tonumber(ARGV[2]) and settled(stream) then
    redis.call('HDEL', KEYS[1], stream)
    redis.call('HSET', KEYS[3], stream, now .. ':' .. listed[i + 1])
    retired = retired + 1
  end
end
return {retired, deleted}
"""
